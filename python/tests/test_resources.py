"""The soak's resource checks (resources.py): what counts as growth (a level, not a peak), and a
real leak caught."""

from __future__ import annotations

import subprocess
import sys
import time

from resources import Sample, Sampler, growth, leaks


def curve(values: list[tuple[float, int]]) -> list[Sample]:
    """Readings a second apart: (resident MiB, descriptors) each."""
    return [Sample(float(t), rss, 10, fds) for t, (rss, fds) in enumerate(values)]


def test_growth_counts_from_the_end_of_the_warm_up():
    warming = curve([(10, 5), (50, 40), (80, 60), (81, 61), (79, 60), (82, 62)])
    assert growth(warming, warmup=2) == {"rss_mib": 2, "threads": 0, "fds": 2}
    assert leaks({"p": warming}, warmup=2) == []
    assert growth(warming[:3], warmup=2) is None, "a curve that ends in its warm-up says nothing"
    # A passing peak (optimize_topology's probe buffers, 70 MiB for a second) is no level.
    peak = curve([(50, 10)] * 20 + [(120, 30)] * 2 + [(50, 10)] * 20)
    assert growth(peak, warmup=2) == {"rss_mib": 0, "threads": 0, "fds": 0}
    leaking = curve([(10, 5)] + [(20, 5 + 10 * k) for k in range(1, 10)])
    assert leaks({"peer3": leaking}, warmup=2, slack={"rss_mib": 64, "threads": 16, "fds": 64}) == [
        "peer3: fds grew by 70 after its warm-up (slack 64)"
    ]


def test_a_process_that_opens_descriptors_and_keeps_them_is_caught():
    leaky = "import time\nheld = []\nwhile True:\n    held.append(open('/dev/null'))\n    time.sleep(0.01)\n"
    procs = {name: subprocess.Popen([sys.executable, "-c", code])
             for name, code in [("leaky", leaky), ("idle", "import time\ntime.sleep(30)")]}
    sampler = Sampler(every=0.05)
    try:
        for name, p in procs.items():
            sampler.watch(name, p.pid)
        sampler.start()
        time.sleep(1.5)
        procs["idle"].kill()
        procs["idle"].wait()
        time.sleep(0.2)
    finally:
        sampler.stop()
        for p in procs.values():
            p.kill()
            p.wait()
    found = leaks(sampler.curves, warmup=0.3, slack={"rss_mib": 64, "threads": 4, "fds": 20})
    assert len(found) == 1 and found[0].startswith("leaky: fds grew by"), found
    idle = sampler.curves["idle"]
    assert idle and idle[-1].t < 1.6, "a process that is gone is read no more"
    summary = sampler.summary(warmup=0.3)
    assert summary["processes"] == summary["past_warmup"] == 2 and summary["max_growth"]["fds"] > 20, summary
