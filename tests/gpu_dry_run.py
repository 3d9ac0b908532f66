"""What can be checked of the GPU path on a machine without a GPU, in its own process
(`python -m tests.gpu_dry_run --arch 90,103`).

1. Every Triton kernel compiles for the CUDA targets. The CPU tests run the kernels under Triton's
   interpreter, which accepts programs the GPU compiler rejects (a helper returning different types from two
   branches) and has no shared-memory limit. Here the interpreter is off and each kernel launch becomes a
   compilation for every target (ptxas ships with Triton; no driver is needed), with the specializations
   that the kernel benchmark's cases at real V4.1 shapes (bf16 and float32 activations, M = 1 and 6) and the
   tiny models' fast path launch. Nothing is executed: outputs are zero-filled allocations, enough to keep
   the host code going.
2. Every decode-cycle step of every tiny family and drafter mode is capturable in a CUDA graph: after the
   warm-up calls a capture would do, a step runs under the product's cycle recorder
   (appliance/measure/recorder.py), which records each operation a capture refuses (a host read of a
   device value, an output whose shape depends on values, a tensor made from host data) with where it
   happened.

It prints one JSON object (compilations per target, kernels never launched, failures, capture violations);
exit status 1 when anything failed.
"""

import os

os.environ["TRITON_INTERPRET"] = "0"  # before Triton is imported: kernels are compiled, not interpreted

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime import jit  # noqa: E402

SHARED_LIMIT = 227 * 1024  # per block, opt-in maximum on sm_90 and sm_100/103


class Compiler:
    """Stands in for JITFunction.run: compiles each new specialization for every target, launches nothing."""

    def __init__(self, archs: list[int]):
        self.targets = [GPUTarget("cuda", a, 32) for a in archs]
        self.done: dict[tuple, float] = {}  # (kernel, arch, signature, constexprs) -> seconds
        self.failures: list[dict] = []
        self.shared = 0  # the most shared memory any compiled kernel asks for, in bytes

    def __call__(self, fn: jit.JITFunction, *args, grid, warmup, **kwargs):
        name = f"{fn.fn.__module__}.{fn.fn.__name__}"
        for target in self.targets:
            backend = make_backend(target)
            bind = jit.create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, options = bind(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            key = (name, target.arch, repr(signature), repr(sorted(constexprs.items())))
            if key in self.done:
                continue
            t = time.perf_counter()
            try:
                k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                   options=options.__dict__)
                if k.metadata.shared > SHARED_LIMIT:  # a launch would fail with OutOfResources
                    self.failures.append({"kernel": name, "arch": target.arch, "error":
                                          f"{k.metadata.shared} bytes of shared memory > {SHARED_LIMIT} "
                                          f"(constexprs {sorted(constexprs.items())})"})
                self.shared = max(self.shared, k.metadata.shared)
            except Exception as e:  # the compiler's message is the finding
                self.failures.append({"kernel": name, "arch": target.arch, "error": str(e)[-2000:]})
            self.done[key] = time.perf_counter() - t


def kernel_names() -> set[str]:
    """Every kernel of kernels/: the functions decorated `@triton.jit` (helpers called from kernels are
    `@device_function`s and compile as part of them)."""
    names = set()
    for name, mod in list(sys.modules.items()):
        if not name.startswith("kernels."):
            continue
        for v in vars(mod).values():
            if (isinstance(v, jit.JITFunction) and v.fn.__module__ == name
                    and inspect.getsource(v.fn).lstrip().startswith("@triton.jit")):
                names.add(f"{name}.{v.fn.__name__}")
    return names


def drive_benchmark_cases(failures: list):
    from kernels import bench

    bench._copies = lambda nbytes, tiny: 1  # no rotation: nothing is timed
    bench.fp4_weight = functools.lru_cache(maxsize=None)(bench.fp4_weight)  # 8 experts share 3 weights
    shapes = dataclasses.replace(bench.V41, experts=8, index_rows=8192)
    for dt in (torch.bfloat16, torch.float32):
        for m in (1, 6):
            for case in bench.BENCHES:
                try:
                    case(shapes, m, torch.device("cpu"), dt, 1, False)
                except Exception:
                    failures.append({"case": f"{case.__name__} {dt} M={m}", "error": traceback.format_exc()[-2000:]})


def drive_cycles(failures: list, violations: list):
    """Generate with every family and drafter mode on the fast path, each cycle step run as a capture
    would: twice to warm up, then under the guard (and under it again for every later replay)."""
    import graphs.runner
    from appliance.api import Request
    from appliance.decode.loop import RequestLoop
    from appliance.decode.session import DecodeSession
    from appliance.loader import load_model
    from appliance.measure.recorder import Recorder
    from appliance.model.tiny import write_tiny
    from appliance.options import RunOptions

    class CheckedRunner:
        def __init__(self, step, device, graphs=True, pool=None, check_inputs=False):
            self.step, self.name = step, type(step).__name__
            step()
            step()
            self.run()

        def run(self):
            with Recorder(label=self.name) as rec:
                out = self.step()
            violations.extend(rec.violations)
            return out

    graphs.runner.make_runner = CheckedRunner
    root = tempfile.mkdtemp()
    for family, draft in (("deepseek_v41", "none"), ("deepseek_v41", "dspark"), ("deepseek_v41", "adaptive"),
                          ("deepseek_v4", "mtp"), ("deepseek_v4_0731", "dspark")):
        try:
            model_dir = write_tiny(os.path.join(root, family), family)
            options = RunOptions(model_dir=model_dir, dtype="bfloat16", path="fast", draft=draft, draft_tokens=3)
            lm = load_model(options, notice=None)
            session = DecodeSession(lm, options, capacity=512, reach_floor=128)  # makes every step now
            gen = RequestLoop(session, lm.tokenizer)
            for _ in gen.run(Request(input_ids=list(range(3, 43)), max_tokens=8, ignore_eos=True)):
                pass
        except Exception:
            failures.append({"case": f"{family} --draft {draft}", "error": traceback.format_exc()[-2000:]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="90,100", help="compute capabilities, e.g. 90 (H100/H200), 100 (B200)")
    archs = [int(a) for a in ap.parse_args().arch.split(",")]
    compiler = Compiler(archs)
    jit.JITFunction.run = lambda fn, *a, grid, warmup, **k: compiler(fn, *a, grid=grid, warmup=warmup, **k)

    import kernels._triton as kt
    import kernels.registry  # noqa: F401  (every kernel module, bound to the helpers patched below)
    from appliance.measure.recorder import unique_violations

    kt.ready = lambda: None  # the fast path resolves although nothing can run here
    for mod in [m for n, m in sys.modules.items() if n.startswith("kernels.")]:
        if hasattr(mod, "device_of"):  # CPU tensors are fine: nothing is launched
            mod.device_of = lambda *ts: next(t.device for t in ts if t is not None)
    torch.empty = torch.zeros  # kernel outputs stay as allocated: zeros keep indices in range
    failures = compiler.failures
    t = time.perf_counter()
    drive_benchmark_cases(failures)
    phases = {"benchmark cases": [len(compiler.done), round(time.perf_counter() - t, 1)]}
    t = time.perf_counter()
    violations: list[dict] = []
    drive_cycles(failures, violations)
    phases["tiny models' cycles"] = [len(compiler.done) - phases["benchmark cases"][0],
                                     round(time.perf_counter() - t, 1)]
    compiled = {a: {} for a in archs}  # arch -> kernel -> specializations compiled
    for name, arch, _, _ in compiler.done:
        compiled[arch][name] = compiled[arch].get(name, 0) + 1
    missing = sorted(kernel_names() - {k[0] for k in compiler.done})
    print(json.dumps({"archs": archs, "compilations": len(compiler.done),
                      "seconds": round(sum(compiler.done.values()), 1),
                      "max_shared_bytes": compiler.shared, "phases (compilations, s)": phases,
                      "compiled": compiled,
                      "never_launched": missing, "failures": failures,
                      "capture_violations": unique_violations(violations)}, indent=1))
    return 1 if failures or missing or violations else 0


if __name__ == "__main__":
    sys.exit(main())
