"""How busy the GPU was in each timed run of a bench (issue #34: is the GPU the limit, or the engine loop?).

    python benchmarks/gpu_busy.py sample gpu.tsv -- qbatch bench prefill --modes vllm-best,qbatch --json p.json
    python benchmarks/gpu_busy.py report gpu.tsv p.engine.log

`sample` runs the command and polls GPU 0 through NVML every 0.1 s meanwhile: its utilisation (the share
of the last sample period in which a kernel ran; not how many of the SMs it used), SM clock and power.
`report` averages the samples inside each run the bench marked in its engine log (steps.py's marks;
their wall clock since the marks carry one); `report ... --timeline` also lists each run's samples, one every
0.2 s (NVML's own period on the H200): where in a run the GPU waited, e.g. while vLLM took in requests.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from steps import MARK  # noqa: E402  (the bench's marks, read as steps.py reads them)

PERIOD_S = 0.1


def sample(path: str, command: list[str]) -> int:
    import pynvml

    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    done = threading.Event()

    def poll() -> None:
        with open(path, "w") as out:
            while not done.wait(PERIOD_S):
                util = pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu
                clock = pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM)
                watts = pynvml.nvmlDeviceGetPowerUsage(gpu) / 1000
                out.write(f"{time.time():.3f}\t{util}\t{clock}\t{watts:.0f}\n")

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        return subprocess.call(command)
    finally:
        done.set()
        poller.join()


def spans(lines: list[str]) -> list[tuple[str, float, float]]:
    """The bench's timed runs in an engine log: (name, start, end) on the wall clock."""
    found, opened = [], {}
    for line in lines:
        if (mark := MARK.search(line)) and mark.group(4):
            name = f"{mark.group(2)} {mark.group(3)}"
            if mark.group(1) == "start":
                opened[name] = float(mark.group(4))
            elif name in opened:
                found.append((name, opened.pop(name), float(mark.group(4))))
    return found


def report(samples_path: str, log_path: str, *, timeline: bool = False) -> list[str]:
    """A line per timed run: its wall time, the GPU's mean utilisation, SM clock and power inside it
    (and with `timeline`, a line of its utilisation samples, every second one)."""
    with open(samples_path) as f:
        rows = [tuple(map(float, line.split("\t"))) for line in f if line.strip()]
    with open(log_path, errors="replace") as f:
        runs = spans(f.readlines())
    lines = []
    for name, start, end in runs:
        inside = [r for r in rows if start <= r[0] <= end]
        if not inside:
            lines.append(f"{name}: no samples")
            continue
        util = [r[1] for r in inside]
        lines.append(f"{name}: {end - start:.2f} s, GPU busy {statistics.mean(util):.1f}% (median "
                     f"{statistics.median(util):.0f}, {len(inside)} samples), SM clock "
                     f"{statistics.mean(r[2] for r in inside):.0f} MHz, {statistics.mean(r[3] for r in inside):.0f} W")
        if timeline:
            lines.append("  every 0.2 s: " + " ".join(f"{r[1]:.0f}" for r in inside[::2]))
    return lines


if __name__ == "__main__":
    if sys.argv[1] == "sample" and "--" in sys.argv:
        sys.exit(sample(sys.argv[2], sys.argv[sys.argv.index("--") + 1:]))
    print("\n".join(report(sys.argv[2], sys.argv[3], timeline="--timeline" in sys.argv[4:])))
