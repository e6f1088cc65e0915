"""Compile candidates in parallel, then run, verify and time them.

    runner = Runner(spec, case, "sm90", device="cuda")
    trials = runner.evaluate([config, ...])      # one Trial per config, in order

For each batch:
1. **compile** every config on a thread pool (TileLang's lowering runs in C++ and releases the
   GIL; threads beat processes there, ``reference/toolchain.md`` Q6). ``parallel="processes"``
   compiles registered specs in worker processes instead: they only fill the on-disk artifact
   cache, and this process then loads each artifact from it (a cache hit).
2. **verify**: outputs are first filled with NaN, the candidate runs once, and every output is
   compared with the spec's reference (computed once per runner) within the spec's tolerance,
   bit for bit for exact specs. A wrong candidate's time never counts.
3. **time**: ``timing.median_ms``: a warm-up of at least 100 ms of work, then ``reps`` runs
   each preceded by an L2 flush and timed with CUDA events; the median is kept. On the CPU
   (``interpret``) the same loop uses ``time.perf_counter``.

A candidate that fails to compile, is wrong, raises, or runs past ``run_timeout`` is recorded
with its reason and the sweep goes on. A timed-out kernel cannot be killed from a thread: its
worker is abandoned (on a GPU a hung kernel keeps the device busy; the report says so).
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from ...codegen.compile import build_phases, load_phases, specialize_phases
from ...codegen.target import get_target
from ...kernels_spec.compare import exact_mismatch
from ...kernels_spec.registry import Spec
from .space import Config, config_key
from .timing import median_ms


class DeviceStuck(TimeoutError):
    """The device still runs a kernel that timed out: nothing more can be measured on it."""


STATUSES = ("ok", "compiled", "pruned", "compile_error", "wrong", "timeout", "run_error")


@dataclass
class Trial:
    config: Config
    status: str
    reason: str = ""
    time_ms: float | None = None  # median measured time, or the cost model's estimate
    metric: str = "measured"  # "measured" | "model"
    compile_s: float | None = None
    max_error: float | None = None
    usage: dict[str, int] = field(default_factory=dict)
    index: int = -1
    is_default: bool = False
    confirmed_ms: float | None = None  # median over the finalists' alternating re-timing rounds
    build: dict[str, int] = field(default_factory=dict)  # what the compiler reported (ptxas: spills)

    @property
    def counts(self) -> bool:
        return self.status in ("ok", "compiled") and self.time_ms is not None

    @property
    def final_ms(self) -> float | None:
        """The time a ranking should use: the confirmed one when the trial was a finalist."""
        return self.confirmed_ms if self.confirmed_ms is not None else self.time_ms

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "config": self.config, "status": self.status, "reason": self.reason,
                "time_ms": self.time_ms, "metric": self.metric, "compile_s": self.compile_s,
                "max_error": self.max_error, "usage": self.usage, "is_default": self.is_default,
                "confirmed_ms": self.confirmed_ms, "build": self.build}


def first_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0][:400] if text else type(err).__name__


@dataclass
class Compiled:
    config: Config
    phases: list  # one bound, lowered module per phase (codegen.compile.specialize_phases)
    artifacts: list  # one build per phase
    compile_s: float


class Runner:
    def __init__(self, spec: Spec, case: dict, target: str, *, device: str | None = None, seed: int = 0,
                 workers: int | None = None, parallel: str = "threads", compile_timeout: float = 600.0,
                 run_timeout: float = 60.0, warmup: int = 3, reps: int = 20, flush_l2: bool | None = None,
                 measure: bool = True, workdir: str | None = None, serial_device: bool | None = None):
        """``serial_device``: runs queue behind each other on the device (a GPU stream: a kernel that
        never ends blocks every later one); by default, true on CUDA."""
        self.spec, self.case, self.target = spec, case, get_target(target)
        self.device = torch.device(device or self.target.runs_on)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # worker threads need an explicit index (torch.cuda.set_device rejects a bare "cuda")
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.seed, self.parallel = seed, parallel
        self._loaded: dict[tuple, object] = {}  # config key -> loaded kernel (see _load)
        self._runaway: tuple[threading.Thread, str] | None = None  # a run that outlived its timeout
        self.stuck: str | None = None  # why nothing more can run on the device, once that is so
        self.serial_device = self.device.type == "cuda" if serial_device is None else serial_device
        self.workers = workers or max(1, min(16, os.cpu_count() or 1))
        self.compile_timeout, self.run_timeout = compile_timeout, run_timeout
        self.warmup, self.reps, self.measure = warmup, reps, measure
        self.flush_l2 = self.device.type == "cuda" if flush_l2 is None else flush_l2
        self.workdir = workdir
        self.constants = spec.constants_of(case)
        self.inputs = spec.make_inputs(case, self.device if measure else torch.device("cpu"), seed)
        self.sig = spec.kernel.bind(self.inputs)
        self._expected: dict[str, torch.Tensor] | None = None

    # -- reference -----------------------------------------------------------------------------
    @property
    def expected(self) -> dict[str, torch.Tensor]:
        if self._expected is None:  # the outputs go too: a reference run in parts takes their shapes
            self._expected = {k: v.detach().clone() for k, v in
                              self.spec.run_reference(self.inputs, self.case).items()}
        return self._expected

    # -- compile -------------------------------------------------------------------------------
    def _compile_one(self, config: Config) -> Compiled:
        t0 = time.perf_counter()
        phases, knobs = specialize_phases(self.spec.kernel, self.sig, self.target, config, self.constants)
        workdir = (os.path.join(self.workdir, f"c{abs(hash(repr(sorted(config.items()))))}")
                   if self.workdir else None)
        artifacts = build_phases(self.spec.kernel, phases, self.target, knobs, workdir)
        return Compiled(config, phases, artifacts, time.perf_counter() - t0)

    def compile(self, configs: list[Config]) -> list[Compiled | Trial]:
        """One ``Compiled`` per config, or a ``compile_error`` / ``timeout`` Trial."""
        if self.parallel == "processes" and self.spec.name and len(configs) > 1:
            self._warm_in_processes(configs)
        out: list[Compiled | Trial] = []
        pool = cf.ThreadPoolExecutor(max_workers=min(self.workers, max(1, len(configs))),
                                     thread_name_prefix="duotile-compile")
        try:
            futures = [pool.submit(self._compile_one, c) for c in configs]
            deadline = time.monotonic() + self.compile_timeout
            for c, fut in zip(configs, futures):
                try:
                    out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
                except cf.TimeoutError:
                    out.append(Trial(c, "timeout", f"compilation ran past {self.compile_timeout:.0f} s"))
                except Exception as err:  # noqa: BLE001 - any failure of a candidate is recorded
                    out.append(Trial(c, "compile_error", first_line(err)))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return out

    def _warm_in_processes(self, configs: list[Config]) -> None:
        ctx = __import__("multiprocessing").get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=min(self.workers, len(configs)), mp_context=ctx) as pool:
            futs = [pool.submit(_compile_registered, self.spec.name, self.case, self.target.name, c, self.seed)
                    for c in configs]
            cf.wait(futs, timeout=self.compile_timeout)

    # -- run -----------------------------------------------------------------------------------
    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _with_timeout(self, fn, timeout: float):
        box: dict[str, Any] = {}

        def work():
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                box["value"] = fn()
            except BaseException as err:  # noqa: BLE001
                box["error"] = err
                box["trace"] = traceback.format_exc()

        self._wait_for_runaway()
        t = threading.Thread(target=work, name="duotile-run", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            self._runaway = (t, f"ran past {timeout:.1f} s")
            raise TimeoutError(f"ran past {timeout:.1f} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _wait_for_runaway(self):
        """A GPU kernel that outlived its timeout cannot be stopped, and everything queued after it
        waits for it: give it one more ``run_timeout``, then refuse to run (a deadlocked kernel would
        otherwise stall every later candidate, one timeout each). On the CPU runs do not queue."""
        if self._runaway is None or not self.serial_device:
            return
        thread, what = self._runaway
        if self.stuck is None:
            thread.join(self.run_timeout)
        if thread.is_alive():
            self.stuck = (f"the device is still busy with a kernel that {what} (and "
                          f"{self.run_timeout:.0f} s more); nothing else can run on it")
            raise DeviceStuck(f"not run: {self.stuck}")
        self._runaway = None

    def _check(self) -> tuple[bool, str, float]:
        worst, problems = 0.0, []
        for name in self.spec.outputs:
            got, want = self.inputs[name], self.expected[name].to(self.inputs[name].device)
            if got.shape != want.shape:
                return False, f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}", math.inf
            if self.spec.exact:
                off = exact_mismatch(name, got, want.to(got.dtype))
                if off:
                    problems.append(f"not bitwise equal to the reference: {off}")
                continue
            g, w = got.float(), want.float()
            err = (g - w).abs()
            finite = torch.isfinite(w)
            allowed = self.spec.allowed_error(self.case, name, w, self.inputs)
            bad = ~((err <= allowed) | (g == w) | (torch.isnan(g) & torch.isnan(w)))  # equal infinities are not off
            e = float(err[finite].max()) if finite.any() else 0.0
            worst = max(worst, e if math.isfinite(e) else math.inf)
            if bad.any():
                problems.append(f"{name}: {int(bad.sum())}/{bad.numel()} elements off "
                                f"(max abs error {e:.3g})")
        return not problems, "; ".join(problems), worst

    def _poison_outputs(self):
        for name in self.spec.outputs:
            t = self.inputs[name]
            if t.dtype.is_floating_point:
                t.fill_(float("nan"))
            else:
                t.fill_(-1)

    def _time(self, fn) -> float:
        tensors = self.inputs
        return median_ms(lambda: fn(tensors), self.device, warmup=self.warmup, reps=self.reps,
                         flush=self.flush_l2)

    def _load(self, c: Compiled):
        """The runnable kernel of a build, loaded once per config (loading JIT-compiles on a GPU)."""
        key = config_key(c.config)
        if key not in self._loaded:
            self._loaded[key] = load_phases(self.target, c.phases, c.artifacts)
        return self._loaded[key]

    def measure_one(self, c: Compiled) -> Trial:
        trial = Trial(c.config, "ok", compile_s=c.compile_s, build=_build_report(c))
        try:
            fn = self._load(c)
        except Exception as err:  # noqa: BLE001
            trial.status, trial.reason = "compile_error", f"load failed: {first_line(err)}"
            return trial
        try:
            self._poison_outputs()
            self._with_timeout(lambda: (fn(self.inputs), self._sync()), self.run_timeout)
        except DeviceStuck as err:
            trial.status, trial.reason = "timeout", str(err)
            return trial
        except TimeoutError as err:
            trial.status, trial.reason = "timeout", f"first run {err}"
            return trial
        except Exception as err:  # noqa: BLE001
            trial.status, trial.reason = "run_error", first_line(err)
            return trial
        ok, why, worst = self._check()
        trial.max_error = worst if math.isfinite(worst) else None
        if not ok:
            trial.status, trial.reason = "wrong", why
            return trial
        try:
            trial.time_ms = self._with_timeout(lambda: self._time(fn), self.run_timeout)
        except TimeoutError as err:
            trial.status, trial.reason = "timeout", f"timing {err}"
        except Exception as err:  # noqa: BLE001
            trial.status, trial.reason = "run_error", first_line(err)
        return trial

    def retime(self, configs: list[Config], rounds: int = 3) -> list[list[float]]:
        """Time already verified configs again, in alternation (A B C, A B C, ...), ``rounds`` times:
        clocks and temperature drift during a sweep, so finalists are compared side by side."""
        fns = []
        for config in configs:
            key = config_key(config)
            if key not in self._loaded:  # not measured by this runner: build (a cache hit) and load
                (item,) = self.compile([config])
                if isinstance(item, Trial):
                    raise RuntimeError(f"a finalist no longer builds: {item.reason}")
                self._load(item)
            fns.append(self._loaded[key])
        times: list[list[float]] = [[] for _ in configs]
        for _ in range(rounds):
            for i, fn in enumerate(fns):
                times[i].append(self._with_timeout(lambda fn=fn: self._time(fn), self.run_timeout))
        return times

    def evaluate(self, configs: list[Config]) -> list[Trial]:
        out = []
        for item in self.compile(configs):
            if isinstance(item, Trial):
                out.append(item)
            elif not self.measure:
                out.append(Trial(item.config, "compiled", compile_s=item.compile_s, build=_build_report(item)))
            else:
                out.append(self.measure_one(item))
        return out


def _build_report(c: Compiled) -> dict[str, int]:
    """What the compiler said of the build (ptxas: registers, spills), the worst over its phases."""
    out: dict[str, int] = {}
    for a in c.artifacts:
        for k, v in ((getattr(a, "meta", None) or {}).get("ptxas") or {}).items():
            out[k] = max(out.get(k, v), v)
    return out


def _compile_registered(spec_name: str, case: dict, target: str, config: Config, seed: int) -> str:
    """Worker-process entry: build one registered kernel's artifact into the shared disk cache."""
    from ...kernels_spec import registry

    spec = registry.get(spec_name)
    inputs = spec.make_inputs(case, torch.device("cpu"), seed)
    tgt = get_target(target)
    phases, knobs = specialize_phases(spec.kernel, spec.kernel.bind(inputs), tgt, config, spec.constants_of(case))
    return build_phases(spec.kernel, phases, tgt, knobs)[0].meta.get("dir", "")
