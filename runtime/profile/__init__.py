"""The profiler: measure a model's blocks on this device, fit the cost model's coefficients,
and calibrate the runtime's own overheads.

    measure.py   measuring blocks over a grid, the point cache, progress, calibrate_runtime
    blocks.py    the block protocol and adapters for runtime/models.py
    clocks.py    CPU / CUDA clocks and the saved-tensor meter
    fit.py       points to coefficients; the all-to-all measurement
    hf.py        the Hugging Face target (config, layer and head adapters)
    fidelity.py  worker side of benchmarks/bench_fidelity.py
"""

from .clocks import CpuClock, CudaClock, SavedBytes, default_clock
from .fit import fit_points, fit_runtime_calibration, measure_all_to_all
from .measure import Grid, ProfileConfig, calibrate_runtime, profile_model

__all__ = [
    "CpuClock",
    "CudaClock",
    "Grid",
    "ProfileConfig",
    "SavedBytes",
    "calibrate_runtime",
    "default_clock",
    "fit_points",
    "fit_runtime_calibration",
    "measure_all_to_all",
    "profile_model",
]
