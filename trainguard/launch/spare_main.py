"""A hot spare: a process that has paid for its imports and waits to become a worker.

    python -u -m trainguard.launch.spare_main [--ready-fd FD] SCRIPT

At start it imports torch, torch.distributed and trainguard's worker side, then preloads the
script's own top-level imports (found with `ast`; a failed preload is remembered, never fatal).
It then writes one byte to FD (if given) and blocks on stdin. EOF or an empty line: the agent
dismissed it, exit 0. Otherwise the line is `{"env": {...}, "argv": [...]}`: the spare takes that
environment and those arguments and runs SCRIPT as a cold-started worker does (worker_main.py):
as `python SCRIPT ARGS...` would, exit codes and tracebacks included, a deterministic error
exiting 78.

Modules that live in the script's own directory are not preloaded: they are the user's, and
may read their rank from the environment at import, which the spare does not have yet.
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import importlib.util
import json
import os
import sys
import time
from typing import NoReturn

from ..config import LOG_LEVEL_ENV
from .worker_main import end_process, run_and_exit, script_path

# torch._dynamo: the first optimizer a process builds imports it (about 1.1 s of a 2 s recovery here)
WORKER_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch.optim", "torch._dynamo",
                  "trainguard.worker.runtime", "trainguard.train.engine.model", "trainguard.train.engine.session",
                  "trainguard.train.state.checkpointing")
EXIT_BAD_ORDER = 2
# torch.compile's machinery, which a process imports at its first compiled call: about 4.7 s of a replacement's first
# step here (bench/recovery.py's torch.compile cell), 1.8 s to import ahead. Preloaded only for a script that calls
# torch.compile; none of these starts a thread or touches a GPU.
COMPILE_MODULES = ("torch._inductor.compile_fx", "torch._functorch.aot_autograd", "torch._dynamo.backends.inductor",
                   "torch.utils.cpp_extension", "torch.export._trace", "torch._inductor.codegen.memory_planning")


def warm_compiler() -> None:
    """What Inductor computes once per process at its first compile and then keeps, done ahead (0.8 s of a 1.6 s first
    compiled step here, with its caches warm): the hash of torch's sources that keys its caches, and the CPU's vector
    instruction set (a probe that compiles and loads a test program in a subprocess, which ends before this returns)."""
    from torch._inductor import codecache, cpu_vec_isa

    codecache.torch_key()
    cpu_vec_isa.pick_vec_isa()


def top_level_imports(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) for each `import x.y` / `from x.y import a, b` (absolute) in the module body."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
    return found


def calls_compile(source: str) -> bool:
    """Whether the script calls `torch.compile` (as `torch.compile(...)`, or `compile` imported from torch)."""
    tree = ast.parse(source)
    from_torch = any(isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0
                     and any(a.name == "compile" and a.asname in (None, "compile") for a in node.names)
                     for node in ast.walk(tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            dotted = isinstance(func, ast.Attribute) and func.attr == "compile" and isinstance(func.value, ast.Name) \
                and func.value.id == "torch"
            if dotted or (from_torch and isinstance(func, ast.Name) and func.id == "compile"):
                return True
    return False


def _is_local(module: str, script_dir: str) -> bool:
    try:
        spec = importlib.util.find_spec(module.partition(".")[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [os.path.dirname(spec.origin)] if spec.origin and spec.has_location else []
    places += [os.path.dirname(p) for p in spec.submodule_search_locations or ()]
    return any(os.path.realpath(p) == script_dir for p in places)


def needs_worker_modules(imports: list[tuple[str, tuple[str, ...]]]) -> bool:
    """Whether torch and trainguard's worker side are worth preloading: not for a script whose top-level
    imports all come from Python's standard library or cannot be found (it would only pay for them)."""
    return any(top not in sys.stdlib_module_names and _findable(top)
               for top in {module.partition(".")[0] for module, _ in imports})


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def preload(script: str, script_dir: str, *, lean: bool = False) -> tuple[list[str], list[str]]:
    """Import what a worker will need; return (loaded, failures), failures as "module: error". `lean`: the
    worker modules only if the script imports something from outside the standard library."""
    loaded: list[str] = []
    failures: list[str] = []
    try:
        with open(script, encoding="utf-8") as f:
            source = f.read()
        imports, compiled = top_level_imports(source), calls_compile(source)
    except (OSError, SyntaxError, ValueError) as exc:  # the script reports this itself when it runs
        failures.append(f"{script}: {exc!r}")
        imports, compiled = [], False
    worker = not lean or needs_worker_modules(imports)
    wanted = ([(m, ()) for m in WORKER_MODULES + (COMPILE_MODULES if compiled else ())] if worker else []) + imports
    for module, names in wanted:
        if module not in WORKER_MODULES + COMPILE_MODULES and _is_local(module, script_dir):
            continue
        try:
            mod = importlib.import_module(module)
            for name in names:  # `from x import y` may name a submodule or a lazy attribute
                if not hasattr(mod, name):
                    importlib.import_module(f"{module}.{name}")
            loaded.append(module)
        except Exception as exc:  # the script's own import will raise it again, in its own words
            failures.append(f"{module}: {exc!r}")
    if worker and compiled:
        try:
            warm_compiler()
        except Exception as exc:  # another torch's internals: the script's first compile does it, as without a spare
            failures.append(f"warm_compiler: {exc!r}")
    return loaded, failures


def _become(script: str, argv: list[str], env: dict[str, str]) -> NoReturn:
    """Take on the worker's environment and arguments and run the script as its __main__ (worker_main.py)."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *argv]
    devnull = os.open(os.devnull, os.O_RDONLY)  # a fresh worker's stdin is /dev/null too
    os.dup2(devnull, 0)
    os.close(devnull)
    run_and_exit(script)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.launch.spare_main")
    parser.add_argument("--ready-fd", type=int, help="write one byte here once warm")
    parser.add_argument("script")
    args = parser.parse_args(argv)
    script = script_path(args.script)  # and its folder first on sys.path, as `python SCRIPT` has it
    script_dir = os.path.dirname(os.path.realpath(script))
    start = time.monotonic()
    loaded, failures = preload(script, script_dir)
    gc.freeze()  # as the zygote does: the worker's collections, and its search for state (discover.py), skip it
    warm_s = time.monotonic() - start
    if args.ready_fd is not None:
        try:
            os.write(args.ready_fd, b"r")
        except OSError as exc:  # the agent's end is gone: nobody will activate this spare
            print(f"[spare] cannot signal readiness ({exc}); exiting", file=sys.stderr)
            return 0
    line = sys.stdin.readline()
    if args.ready_fd is not None:
        os.close(args.ready_fd)  # EOF there tells the agent this spare is no longer idle
    if not line.strip():
        return 0  # dismissed
    try:
        order = json.loads(line)
        env, script_args = dict(order["env"]), [str(a) for a in order["argv"]]
    except (ValueError, KeyError, TypeError) as exc:
        print(f"[spare] bad activation line ({exc!r}); expected {{\"env\": {{...}}, \"argv\": [...]}}",
              file=sys.stderr)
        return EXIT_BAD_ORDER
    if env.get(LOG_LEVEL_ENV, "").strip().upper() == "DEBUG":
        print(f"[spare] preloaded {len(loaded)} modules in {warm_s:.2f} s", file=sys.stderr)
        for failure in failures:
            print(f"[spare] preload failed: {failure}", file=sys.stderr)
    _become(script, script_args, env)
    return 0


if __name__ == "__main__":
    end_process(main(), collect=False)  # a dismissed spare: torch's teardown would take 2 s of CPU
