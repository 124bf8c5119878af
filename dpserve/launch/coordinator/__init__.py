"""The DP coordinator: one process between the DP engines and the front-ends.

    handle.py     `DPCoordinator`: the launcher's handle (spawn, restart, stop)
    proc.py       `DPCoordinatorProc`: the process's sockets and loop, `run_coordinator`
    tables.py     `LoadTable`, `HealthTable`, `ControlBook`: each rank's counts, health,
                  pause / sleep
    waves.py      `Waves`: the request wave, running or paused
    dp_group.py   `DPGroup`: lockstep DP group generations
    autoscale.py  `ScaleBook`, `Autoscaler`: run-time changes of the engine count
    loras.py      `LoRARegistry`: the DP-wide LoRA adapter registry
    prefix_relay.py  `PrefixRelay`: API servers' prefix facts, relayed to the others
"""

from dpserve.launch.coordinator.dp_group import REFORM_DELAY_S
from dpserve.launch.coordinator.handle import DPCoordinator
from dpserve.launch.coordinator.proc import DPCoordinatorProc, run_coordinator

__all__ = ["REFORM_DELAY_S", "DPCoordinator", "DPCoordinatorProc", "run_coordinator"]
