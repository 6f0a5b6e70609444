"""The WAN lab: hosts in network namespaces on one machine, with real round-trip times, link
caps, TCP window limits, loss and faults (``shoal lab``; ``docs/lab.md``)."""

from .lab import FAULT_KINDS, Lab, LabError, names, remove, stop, toxiproxy_binary, unavailable
from .profiles import PROFILES
from .spec import Spec, SpecError, build, load

__all__ = ["FAULT_KINDS", "Lab", "LabError", "PROFILES", "Spec", "SpecError", "build", "load", "names", "remove",
           "stop", "toxiproxy_binary", "unavailable"]
