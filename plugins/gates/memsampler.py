"""Peak memory while a workload runs: a sampler thread, and the allocator's exact peak to check it against.

A sampler sees only the instants it looks at; a short spike between two samples is
missed. So every report carries both figures, the sampled peak and an exact
high-water mark kept by the allocator or the kernel, and says how far apart they are.

- CPU: the process's RSS (``VmRSS`` in /proc/self/status), against ``VmHWM``
  (reset at start through /proc/self/clear_refs where the kernel allows it), else
  ``ru_maxrss``. Machine-wide: ``MemTotal``/``MemAvailable``, narrowed by a cgroup limit.
- GPU: device-wide used memory from NVML (what nvidia-smi shows; ``nvidia-ml-py``),
  or ``torch.cuda.mem_get_info`` without it, against ``torch.cuda.max_memory_reserved``.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import attrs

from kestrel_core.errors import ConfigError
from kestrel_core.engine.host import meminfo

DEFAULT_PERIOD_S = 0.5
_KB = 1024


@attrs.frozen
class Sample:
    t: float  # seconds since start
    process_bytes: int  # the sampled figure: CPU, this process's VmRSS; GPU, the device-wide use (as nvidia-smi)
    used_bytes: int  # the whole device / machine
    available_bytes: int


@attrs.frozen
class MemReport:
    device: str
    period_s: float
    samples: int
    duration_s: float
    sampled_source: str
    start_process_bytes: int
    sampled_peak_bytes: int  # peak of the sampled figure (CPU: process RSS; GPU: device-wide used)
    exact_peak_bytes: int | None  # the allocator's / kernel's own high-water mark
    exact_source: str
    total_bytes: int
    used_source: str
    peak_used_bytes: int  # device- or machine-wide, the quantity a headroom is taken from
    min_available_bytes: int
    start_available_bytes: int
    notes: tuple[str, ...] = ()

    @property
    def gap_bytes(self) -> int | None:
        """exact - sampled: on the CPU, what sampling missed; on the GPU, also the CUDA context and non-torch memory."""
        return None if self.exact_peak_bytes is None else self.exact_peak_bytes - self.sampled_peak_bytes

    @property
    def gap_fraction(self) -> float | None:
        if self.exact_peak_bytes is None or not self.exact_peak_bytes:
            return None
        return self.gap_bytes / self.exact_peak_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.min_available_bytes

    def to_json(self) -> dict:
        d = attrs.asdict(self)
        d["notes"] = list(self.notes)
        d["gap_bytes"] = self.gap_bytes
        d["gap_fraction"] = self.gap_fraction
        d["headroom_bytes"] = self.headroom_bytes
        return d

    def describe(self) -> str:
        """One line: sampled peak, exact peak, and how far apart."""
        mib = 2**20
        line = (f"sampled peak {self.sampled_peak_bytes / mib:,.1f} MiB ({self.sampled_source}, "
                f"{self.samples} samples every {self.period_s * 1e3:.0f} ms over {self.duration_s:.2f} s)")
        if self.exact_peak_bytes is None:
            return line + f"; no exact peak ({self.exact_source})"
        gap = self.gap_bytes
        frac = self.gap_fraction
        return (line + f"; exact peak {self.exact_peak_bytes / mib:,.1f} MiB ({self.exact_source}); "
                f"apart by {gap / mib:+,.1f} MiB ({frac:+.1%} of the exact peak)")


# --- CPU probes --------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * _KB
    except OSError:
        return None
    return None


def process_rss_bytes() -> int:
    """This process's resident set now (VmRSS; smaps_rollup where status lacks it)."""
    rss = _status_kb("VmRSS")
    if rss is not None:
        return rss
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                return int(line.split()[1]) * _KB
    except OSError:
        pass
    raise ConfigError("cannot read this process's RSS (no /proc/self/status or smaps_rollup); the CPU sampler needs Linux")


def _ru_maxrss_bytes() -> int:
    # Linux reports kilobytes, macOS bytes.
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return ru if os.uname().sysname == "Darwin" else ru * _KB


def reset_rss_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _cgroup_limit() -> tuple[int | None, int | None]:
    """(limit, current) of the cgroup v2 this process is in, where one is set."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split("::", 1)[1]
    except (OSError, IndexError):
        rel = ""
    for base in (Path("/sys/fs/cgroup") / rel.lstrip("/"), Path("/sys/fs/cgroup")):
        try:
            raw = (base / "memory.max").read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None, None
        try:
            limit = int(raw)
            current = int((base / "memory.current").read_text().strip())
        except (OSError, ValueError):
            return None, None
        return limit, current
    return None, None


def machine_memory() -> tuple[int, int]:
    """(total, available) bytes for this process: MemTotal/MemAvailable, narrowed by a cgroup limit."""
    info = meminfo()
    total = info.get("MemTotal")
    if total is None:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages
    available = info.get("MemAvailable", info.get("MemFree", 0))
    limit, current = _cgroup_limit()
    if limit is not None and limit < total:
        total = limit
        available = min(available, max(0, limit - (current or 0)))
    return total, available


class _CpuProbe:
    device = "cpu"
    sampled_source = "process RSS (/proc/self/status VmRSS)"
    used_source = "machine used (MemTotal - MemAvailable, within any cgroup limit)"

    def __init__(self):
        self.notes: list[str] = []
        self.hwm_reset = reset_rss_high_water_mark()
        if not self.hwm_reset:
            self.notes.append("could not reset VmHWM (/proc/self/clear_refs not writable): the exact peak covers the whole process life")

    def sample(self) -> tuple[int, int, int]:
        rss = process_rss_bytes()
        total, available = machine_memory()
        return rss, total - available, available

    def total(self) -> int:
        return machine_memory()[0]

    def exact_peak(self) -> tuple[int | None, str]:
        hwm = _status_kb("VmHWM")
        if hwm is not None:
            return hwm, "VmHWM" + ("" if self.hwm_reset else ", since process start")
        return _ru_maxrss_bytes(), "ru_maxrss, since process start"

    def close(self) -> None:
        pass


# --- GPU probe -----------------------------------------------------------------------------
def _import_nvml():
    """pynvml (shipped by nvidia-ml-py), or None when it isn't installed or NVML won't start."""
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml.NVMLError and friends: no driver, no device
        return None
    return pynvml


def _nvml_handle(nvml, index: int):
    """The NVML handle of torch's device ``index``: by UUID, then PCI bus id (CUDA_VISIBLE_DEVICES renumbers)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        # nvidia-ml-py versions differ on str or bytes arguments; try both.
        for candidate in (f"GPU-{text}", text, f"GPU-{text}".encode(), text.encode()):
            try:
                return nvml.nvmlDeviceGetHandleByUUID(candidate)
            except Exception:
                pass
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        domain = getattr(props, "pci_domain_id", 0)
        dev = getattr(props, "pci_device_id", 0)
        bus_id = f"{domain:08X}:{bus:02X}:{dev:02X}.0"
        for candidate in (bus_id, bus_id.encode()):
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(candidate)
            except Exception:
                pass
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        try:
            return nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            pass
    return None


class _GpuProbe:
    def __init__(self, device: str):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"cannot sample {device}: no CUDA device is visible (sample 'cpu' instead)")
        dev = torch.device(device)
        self.index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.device = f"cuda:{self.index}"
        self._torch = torch
        self.notes: list[str] = []
        self._nvml = _import_nvml()
        self._handle = _nvml_handle(self._nvml, self.index) if self._nvml else None
        if self._handle is None:
            why = "nvidia-ml-py is not installed" if self._nvml is None else "NVML could not find this device"
            self.notes.append(f"{why}: sampling torch.cuda.mem_get_info instead of NVML")
            self.sampled_source = "device used (torch.cuda.mem_get_info)"
        else:
            self.sampled_source = "device used (NVML, as nvidia-smi)"
        self.used_source = self.sampled_source
        torch.cuda.reset_peak_memory_stats(self.index)

    def _info(self) -> tuple[int, int, int]:
        if self._handle is not None:
            try:
                m = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
                return int(m.total), int(m.used), int(m.free)
            except Exception:
                pass
        free, total = self._torch.cuda.mem_get_info(self.index)
        return int(total), int(total - free), int(free)

    def sample(self) -> tuple[int, int, int]:
        total, used, free = self._info()
        # The sampled figure on a GPU is the device-wide use (the seed's nvidia-smi method).
        return used, used, free

    def total(self) -> int:
        return self._info()[0]

    def exact_peak(self) -> tuple[int | None, str]:
        return int(self._torch.cuda.max_memory_reserved(self.index)), "torch.cuda.max_memory_reserved (this process's caching allocator)"

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass


def _probe(device: str):
    if device == "cpu":
        return _CpuProbe()
    if device.startswith("cuda"):
        return _GpuProbe(device)
    raise ConfigError(f"cannot sample memory of device {device!r}: use 'cpu' or 'cuda[:N]'")


class MemSampler:
    """Sample memory every ``period_s`` on a daemon thread while a workload runs.

    Use as a context manager; ``report`` is set on exit. A sample is also taken at
    start and at stop, so even a workload shorter than one period has two.
    """

    def __init__(self, device: str = "cpu", period_s: float = DEFAULT_PERIOD_S):
        if not period_s > 0:
            raise ConfigError(f"the sampling period must be positive, got {period_s} s")
        self.period_s = float(period_s)
        self.requested_device = str(device)
        self.samples: list[Sample] = []
        self.report: MemReport | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._probe = None
        self._t0 = 0.0
        self._errors: list[str] = []

    def _take(self) -> None:
        try:
            proc, used, avail = self._probe.sample()
        except Exception as exc:  # a probe failing mid-run must not kill the workload
            self._errors.append(f"a sample failed: {exc}")
            return
        self.samples.append(Sample(time.perf_counter() - self._t0, proc, used, avail))

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def start(self) -> "MemSampler":
        self._probe = _probe(self.requested_device)
        self._t0 = time.perf_counter()
        self._take()
        if not self.samples:
            raise ConfigError(f"the memory sampler cannot read {self.requested_device}: {self._errors[-1]}")
        self._thread = threading.Thread(target=self._loop, name="kestrel-memsampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> MemReport:
        if self._thread is None:
            raise RuntimeError("MemSampler.stop() before start()")
        self._stop.set()
        self._thread.join()
        self._take()
        duration = time.perf_counter() - self._t0
        exact, exact_source = self._probe.exact_peak()
        notes = list(self._probe.notes) + self._errors[:3]
        total = self._probe.total()
        sampled_peak = max(s.process_bytes for s in self.samples)
        if self._probe.device == "cpu" and exact is not None and exact < sampled_peak:
            notes.append(f"VmHWM read {(sampled_peak - exact) / 2**10:,.0f} KiB below a sample: the kernel batches its "
                         "RSS counters, so both CPU figures are good to a few hundred KiB")
        self.report = MemReport(
            device=self._probe.device,
            period_s=self.period_s,
            samples=len(self.samples),
            duration_s=duration,
            sampled_source=self._probe.sampled_source,
            start_process_bytes=self.samples[0].process_bytes,
            sampled_peak_bytes=sampled_peak,
            exact_peak_bytes=exact,
            exact_source=exact_source,
            total_bytes=total,
            used_source=self._probe.used_source,
            peak_used_bytes=max(s.used_bytes for s in self.samples),
            min_available_bytes=min(s.available_bytes for s in self.samples),
            start_available_bytes=self.samples[0].available_bytes,
            notes=tuple(notes),
        )
        self._probe.close()
        return self.report

    def __enter__(self) -> "MemSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
