// The compiled part of the shoal backend of torch.distributed (python/shoal/_c10d.py builds it
// with torch.utils.cpp_extension on first use and falls back to Python where it cannot).
//
// `FastBackend` is the base class of `shoal._c10d.ShoalBackend`. It runs the blocking
// all-reduce of one CPU tensor (`dist.all_reduce(t)`, the call a training loop makes most)
// itself: c10d hands it the tensor, and it calls shoal's native all-reduce through the capsule
// of `Communicator.torch_api()`, with no Python in between. Everything else, and any all-reduce
// it does not take as is, goes to the Python methods of the subclass through torch's own
// trampoline's way (pybind11's overrides, the works held by torch's `PyWorkHolder`), exactly as
// when the backend is Python alone. (torch's own trampoline, `PyBackend`, looks its overrides up
// as `Backend`'s, which a Python subclass of this class is not: this class forwards them itself.)

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/py/PyProcessGroup.hpp>
#include <torch/python.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;

// The layout of `TorchApi` in python/src/lib.rs.
struct Api {
  uint32_t version;
  const void* group;
  int32_t (*all_reduce)(const void* group, void* data, size_t bytes,
                        const char* dtype, const char* op, uint64_t tag);
};
constexpr uint32_t kApiVersion = 1;
constexpr const char* kApiName = "shoal._native.TorchApi";

// Tags of the backend's own collectives run below this (_c10d._COMPOSED: composed operations
// and point-to-point transfers use the tags above).
constexpr uint64_t kComposed = uint64_t{1} << 61;

// shoal's name of a dtype it reduces, or null.
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kByte: return "u8";
    case at::kChar: return "i8";
    case at::kShort: return "i16";
    case at::kUInt16: return "u16";
    case at::kInt: return "i32";
    case at::kUInt32: return "u32";
    case at::kLong: return "i64";
    case at::kUInt64: return "u64";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    case at::kFloat: return "f32";
    case at::kDouble: return "f64";
    default: return nullptr;
  }
}

// shoal's name of a reduction it runs, or null.
const char* op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return "sum";
    case c10d::ReduceOp::AVG: return "avg";
    case c10d::ReduceOp::PRODUCT: return "prod";
    case c10d::ReduceOp::MIN: return "min";
    case c10d::ReduceOp::MAX: return "max";
    default: return nullptr;
  }
}

// The work of a call that ended before returning: its future holds its tensors.
class DoneWork : public c10d::Work {
 public:
  explicit DoneWork(std::vector<at::Tensor> result) : result_(std::move(result)) {}

  bool wait(std::chrono::milliseconds) override { return true; }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  std::vector<at::Tensor> result() override { return result_; }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(result_));
    return future;
  }

 private:
  std::vector<at::Tensor> result_;
};

// A receive's work, held for c10d as torch's `PyWorkHolder` holds a Python work, that also
// answers which rank sent (`dist.recv` without `src` asks): torch's holder cannot, so this one
// asks the Python work's `_source_rank()`.
class SourceWork : public c10d::Work {
 public:
  explicit SourceWork(py::object work) : work_(work.cast<c10::intrusive_ptr<c10d::Work>>()), py_(std::move(work)) {}

  ~SourceWork() override {
    py::gil_scoped_acquire gil;
    py_ = py::object();
  }

  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

  int sourceRank() const override {
    py::gil_scoped_acquire gil;
    return py_.attr("_source_rank")().cast<int>();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  py::object py_;
};

// The Python method `name` of the subclass, with the arguments after it: its work, held for
// c10d by a `Holder`; the base class's `method` where the subclass has none. SHOAL_FORWARD: the
// method of the same name, its work held as torch holds it.
#define SHOAL_FORWARD_HELD(method, name, Holder, ...)                                         \
  do {                                                                                      \
    py::gil_scoped_acquire gil;                                                             \
    py::function override = py::get_override(static_cast<const FastBackend*>(this), name); \
    if (override) {                                                                         \
      py::object work = override(__VA_ARGS__);                                              \
      if (work.is_none()) {                                                                 \
        return {};                                                                          \
      }                                                                                     \
      return c10::make_intrusive<Holder>(std::move(work));                                  \
    }                                                                                       \
    return c10d::Backend::method(__VA_ARGS__);                                              \
  } while (false)
#define SHOAL_FORWARD(method, ...) \
  SHOAL_FORWARD_HELD(method, #method, c10d::PyProcessGroup::PyWorkHolder, __VA_ARGS__)

using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

class FastBackend : public c10d::Backend {
 public:
  FastBackend(int rank, int size) : c10d::Backend(rank, size) {}

  ~FastBackend() override {
    if (Py_IsInitialized() != 0) {  // Python objects are freed with the GIL held
      py::gil_scoped_acquire gil;
      capsule_ = py::capsule();
      as_torch_error_ = py::object();
    } else {
      capsule_.release();
      as_torch_error_.release();
    }
  }

  // Gives the backend its shoal group (the capsule of `Communicator.torch_api()`) and the
  // function that turns a shoal error into its torch twin (`_c10d._as_torch_error`).
  void attach(py::capsule api, py::object as_torch_error) {
    auto* raw = static_cast<const Api*>(PyCapsule_GetPointer(api.ptr(), kApiName));
    if (raw == nullptr) {
      throw py::error_already_set();
    }
    if (raw->version != kApiVersion) {
      throw std::runtime_error("shoal's torch backend was built for another version of shoal._native");
    }
    capsule_ = std::move(api);
    as_torch_error_ = std::move(as_torch_error);
    api_ = raw;
  }

  // The sequence number of the backend's next collective: one counter for the calls run here
  // and those of the Python methods, so every member tags the same call alike.
  uint64_t next_seq() { return seq_.fetch_add(1, std::memory_order_relaxed) + 1; }

  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    if (api_ != nullptr && !opts.asyncOp && tensors.size() == 1) {
      at::Tensor& t = tensors[0];
      const char* dtype = dtype_name(t.scalar_type());
      const char* op = op_name(opts.reduceOp);
      if (dtype != nullptr && op != nullptr && t.device().is_cpu() && t.layout() == at::kStrided &&
          t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
        uint64_t tag = next_seq() % kComposed;
        if (api_->all_reduce(api_->group, t.data_ptr(), t.nbytes(), dtype, op, tag) != 0) {
          raise_as_torch_error();
        }
        return c10::make_intrusive<DoneWork>(tensors);
      }
    }
    SHOAL_FORWARD(allreduce, tensors, opts);
  }

  const std::string getBackendName() const override { return "shoal"; }

  void shutdown() override {
    py::gil_scoped_acquire gil;
    if (py::function override = py::get_override(static_cast<const FastBackend*>(this), "shutdown")) {
      override();
    }
  }

  WorkPtr broadcast(Tensors& t, const c10d::BroadcastOptions& o) override { SHOAL_FORWARD(broadcast, t, o); }
  WorkPtr allreduce_coalesced(Tensors& t, const c10d::AllreduceCoalescedOptions& o) override {
    SHOAL_FORWARD(allreduce_coalesced, t, o);
  }
  WorkPtr reduce(Tensors& t, const c10d::ReduceOptions& o) override { SHOAL_FORWARD(reduce, t, o); }
  WorkPtr allgather(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    SHOAL_FORWARD(allgather, out, in, o);
  }
  WorkPtr all_gather_single(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    SHOAL_FORWARD(all_gather_single, out, in, o);
  }
  WorkPtr allgather_coalesced(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    SHOAL_FORWARD(allgather_coalesced, out, in, o);
  }
  WorkPtr all_gather_single_coalesced(Tensors& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    SHOAL_FORWARD(all_gather_single_coalesced, out, in, o);
  }
  WorkPtr gather(TensorLists& out, Tensors& in, const c10d::GatherOptions& o) override {
    SHOAL_FORWARD(gather, out, in, o);
  }
  WorkPtr scatter(Tensors& out, TensorLists& in, const c10d::ScatterOptions& o) override {
    SHOAL_FORWARD(scatter, out, in, o);
  }
  WorkPtr reduce_scatter(Tensors& out, TensorLists& in, const c10d::ReduceScatterOptions& o) override {
    SHOAL_FORWARD(reduce_scatter, out, in, o);
  }
  WorkPtr reduce_scatter_single(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    SHOAL_FORWARD(reduce_scatter_single, out, in, o);
  }
  WorkPtr reduce_scatter_single_coalesced(Tensors& out, Tensors& in, const c10d::ReduceScatterOptions& o) override {
    SHOAL_FORWARD(reduce_scatter_single_coalesced, out, in, o);
  }
  WorkPtr all_to_all_single(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                            std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    SHOAL_FORWARD(all_to_all_single, out, in, out_splits, in_splits, o);
  }
  WorkPtr alltoall(Tensors& out, Tensors& in, const c10d::AllToAllOptions& o) override {
    SHOAL_FORWARD(alltoall, out, in, o);
  }
  WorkPtr send(Tensors& t, int dst, int tag) override { SHOAL_FORWARD(send, t, dst, tag); }
  WorkPtr recv(Tensors& t, int src, int tag) override { SHOAL_FORWARD(recv, t, src, tag); }
  WorkPtr recvAnysource(Tensors& t, int tag) override {
    SHOAL_FORWARD_HELD(recvAnysource, "recv_anysource", SourceWork, t, tag);
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override { SHOAL_FORWARD(barrier, o); }

 private:
  // Raises the error shoal set as its torch twin (a DistBackendError that keeps its class).
  [[noreturn]] void raise_as_torch_error() {
    py::gil_scoped_acquire gil;
    py::error_already_set error;
    py::object twin = as_torch_error_(error.value());
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(twin.ptr())), twin.ptr());
    throw py::error_already_set();
  }

  const Api* api_ = nullptr;
  py::capsule capsule_;  // keeps the group `api_` points into alive
  py::object as_torch_error_;
  std::atomic<uint64_t> seq_{0};
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<FastBackend, c10d::Backend, c10::intrusive_ptr<FastBackend>>(m, "FastBackend")
      .def(py::init<int, int>())
      .def("_attach", &FastBackend::attach)
      .def("_next_seq", &FastBackend::next_seq);
}
