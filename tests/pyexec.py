"""``python -c code`` (``-m module``, ``script``) for tests, forked from a pre-imported interpreter (a zygote): the docs
examples and CLI tests need a clean interpreter, and each fresh one paid ``import torch`` and the zoos (6-8 s of CPU)
again."""
from __future__ import annotations

import atexit
import json
import locale
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: third-party packages the zygote imports (each only if importable); never pid_plugins or anything importing it
PRELOAD = ("numpy", "torch", "torch.nn", "torch.distributed", "timm", "transformers", "mmengine", "mmcv", "mmseg",
           "fairseq", "peft", "matplotlib", "scipy")

#: variables that differ from call to call and that no import reads: a change of these does not need a new zygote
#: (the child still gets the caller's value)
PER_CALL = frozenset({"PYTEST_CURRENT_TEST"})

DISABLED = bool(os.environ.get("PID_TEST_NO_FORKSERVER")) or not hasattr(os, "fork")

# The zygote's program, run as ``python -c ZYGOTE`` (so its sys.path is a clean -c interpreter's).
ZYGOTE = r'''
import os, sys
_rfd, _wfd = int(sys.argv[1]), int(sys.argv[2])
del sys.argv[1:]
import atexit, builtins, importlib, importlib.machinery, io, json, logging, random, runpy, signal, struct, threading
import types, warnings
_PATH = list(sys.path)
_FILTERS = list(warnings.filters)
_SHOWWARNING = warnings.showwarning
_ROOT = (logging.root.level, list(logging.root.handlers), list(logging.root.filters))
_STREAMS = [(s.encoding, s.errors, s.line_buffering) for s in (sys.stdout, sys.stderr)]
os.dup2(2, 1)
for _name in os.environ["PID_PYEXEC_PRELOAD"].split(","):
    try:
        importlib.import_module(_name)
    except Exception:  # not installed here: the child imports it (and fails) as a fresh interpreter would
        pass
sys.stdout.flush(); sys.stderr.flush()

def _send(obj):
    data = json.dumps(obj).encode()
    os.write(_wfd, struct.pack("!I", len(data)) + data)

def _recv():
    head = b""
    while len(head) < 4:
        chunk = os.read(_rfd, 4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        data += os.read(_rfd, n - len(data))
    return json.loads(data)

def _hook(e):
    """sys.excepthook on the exception without this program's own frame (as the interpreter reports it)."""
    tb = e.__traceback__.tb_next
    sys.excepthook(type(e), e.with_traceback(tb), tb)

def _child(req):
    os.close(_rfd); os.close(_wfd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd = os.open(os.devnull, os.O_RDONLY); os.dup2(fd, 0); os.close(fd)
    fd = os.open(req["stdout"], os.O_WRONLY | os.O_TRUNC); os.dup2(fd, 1); os.close(fd)
    fd = os.open(req["stderr"], os.O_WRONLY | os.O_TRUNC); os.dup2(fd, 2); os.close(fd)
    streams = []
    for n, (enc, err, lb) in zip((1, 2), _STREAMS):
        streams.append(io.TextIOWrapper(io.BufferedWriter(io.FileIO(n, "w", closefd=False)), encoding=enc,
                                        errors=err, line_buffering=lb))
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__ = streams
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    os.chdir(req["cwd"])
    os.environ.clear(); os.environ.update(req["env"])
    if req["module"]:  # python -m module args: sys.path[0] is the cwd, runpy sets argv[0] to the module's file
        sys.argv[:] = ["-m", *req["args"]]
        sys.orig_argv = [sys.executable, "-m", req["module"], *req["args"]]
        sys.path[:] = [os.getcwd(), *_PATH[1:]]
    elif req.get("script"):  # python file args: sys.path[0] is the file's folder (links resolved), argv[0] the file
        sys.argv[:] = [req["script"], *req["args"]]
        sys.orig_argv = [sys.executable, req["script"], *req["args"]]
        sys.path[:] = [os.path.dirname(os.path.realpath(req["script"])), *_PATH[1:]]
    else:
        sys.argv[:] = ["-c", *req["args"]]
        sys.orig_argv = [sys.executable, "-c", req["code"], *req["args"]]
        sys.path[:] = _PATH
    warnings.filters[:] = _FILTERS
    warnings._filters_mutated()
    warnings.showwarning = _SHOWWARNING
    logging.root.setLevel(_ROOT[0]); logging.root.handlers[:] = _ROOT[1]; logging.root.filters[:] = _ROOT[2]
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter, __spec__=None,
                         __package__=None, __annotations__={})
    sys.modules["__main__"] = main
    rc = 0
    try:
        if req["module"]:
            runpy._run_module_as_main(req["module"], alter_argv=True)
        elif req.get("script"):  # as the interpreter runs a file: __file__, its source loader, no spec
            main.__dict__.update(__file__=req["script"], __cached__=None,
                                 __loader__=importlib.machinery.SourceFileLoader("__main__", req["script"]))
            with open(req["script"], "rb") as f:
                source = f.read()
            exec(compile(source, req["script"], "exec", dont_inherit=True), main.__dict__)
        else:
            exec(compile(req["code"], "<string>", "exec", dont_inherit=True), main.__dict__)
    except SystemExit as e:
        code = e.code
        if code is None:
            rc = 0
        elif isinstance(code, int):
            rc = code & 0xFF
        else:
            try:
                print(code, file=sys.stderr)
            except Exception:
                pass
            rc = 1
    except KeyboardInterrupt as e:
        _hook(e); rc = -signal.SIGINT
    except BaseException as e:
        _hook(e); rc = 1
    try:
        threading._shutdown()
    except BaseException:
        pass
    atexit._run_exitfuncs()
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            if rc == 0:
                rc = 120
    if rc == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGINT)
    os._exit(rc)

_send({"pid": os.getpid()})  # ready
while True:
    req = _recv()
    if req is None:
        break
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            _child(req)
        finally:
            os._exit(70)
    _send({"pid": pid})
    _, status = os.waitpid(pid, 0)
    _send({"status": os.waitstatus_to_exitcode(status)})
'''


class Zygote:
    """One zygote process (started with environment ``env``); :meth:`run` forks a child of it per call."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        self.dir = Path(tempfile.mkdtemp(prefix="pyexec-"))
        self.log = open(self.dir / "zygote.log", "wb")
        r_req, w_req = os.pipe()
        r_rep, w_rep = os.pipe()
        empty = self.dir / "cwd"
        empty.mkdir()
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(r_req), str(w_rep)], cwd=empty,
                                     env={**self.env, "PID_PYEXEC_PRELOAD": ",".join(PRELOAD)},
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     pass_fds=(r_req, w_rep))
        os.close(r_req)
        os.close(w_rep)
        self.w, self.r = w_req, r_rep
        self.lock = threading.Lock()
        self.info = self._recv(timeout=600)
        if self.info is None:
            raise RuntimeError(f"the zygote did not start: {(self.dir / 'zygote.log').read_text()[-3000:]}")

    def _send(self, obj) -> None:
        data = json.dumps(obj).encode()
        os.write(self.w, struct.pack("!I", len(data)) + data)

    def _read(self, n: int, deadline: float | None) -> bytes | None:
        data = b""
        while len(data) < n:
            if deadline is not None:
                left = deadline - _now()
                if left <= 0 or not select.select([self.r], [], [], left)[0]:
                    raise TimeoutError
            chunk = os.read(self.r, n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def _recv(self, timeout: float | None = None):
        deadline = None if timeout is None else _now() + timeout
        head = self._read(4, deadline)
        if head is None:
            return None
        data = self._read(struct.unpack("!I", head)[0], None)
        return None if data is None else json.loads(data)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, code: str | None, cwd, env: dict[str, str], timeout: float | None, args=(),
            module: str | None = None, script: str | None = None) -> subprocess.CompletedProcess:
        """``python -c code *args`` (or ``python -m module *args``, ``python script *args``) in a new child."""
        args = [str(a) for a in args]
        cmd = [sys.executable, *(["-m", module] if module else [script] if script else ["-c", code]), *args]
        with self.lock, tempfile.TemporaryDirectory(dir=self.dir) as out:
            paths = {k: os.path.join(out, k) for k in ("stdout", "stderr")}
            for p in paths.values():
                open(p, "wb").close()
            self._send({"code": code, "module": module, "script": script, "args": args, "cwd": os.fspath(cwd),
                        "env": env, **paths})
            pid = self._recv()["pid"]
            try:
                reply = self._recv(timeout)
            except TimeoutError:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self._recv()
                raise subprocess.TimeoutExpired(cmd, timeout, _read_text(paths["stdout"]),
                                                _read_text(paths["stderr"])) from None
            if reply is None:
                raise RuntimeError(f"the zygote died: {(self.dir / 'zygote.log').read_text()[-3000:]}")
            return subprocess.CompletedProcess(cmd, reply["status"], _read_text(paths["stdout"]),
                                               _read_text(paths["stderr"]))

    def close(self) -> None:
        for fd in (self.w, self.r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _now() -> float:
    import time

    return time.monotonic()


def _read_text(path: str) -> str:
    """As ``subprocess.run(text=True)`` decodes: the locale's encoding, universal newlines."""
    data = Path(path).read_bytes().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


_ZYGOTES: dict[tuple, Zygote] = {}
_LOCK = threading.Lock()


def zygote(env: dict[str, str] | None = None) -> Zygote:
    """The zygote for ``env`` (default ``os.environ``), started on first use and kept for the process's life
    (at most two at a time: the oldest is closed)."""
    env = dict(os.environ if env is None else env)
    key = tuple(sorted((k, v) for k, v in env.items() if k not in PER_CALL))
    with _LOCK:
        z = _ZYGOTES.get(key)
        if z is None or not z.alive():
            if z is not None:
                z.close()
            while len(_ZYGOTES) >= 2:
                _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
            z = _ZYGOTES[key] = Zygote(env)
        return z


def run_python_c(code: str, cwd=None, env: dict[str, str] | None = None, timeout: float | None = None,
                 fork: bool | None = None, args=()) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``, from a fork of the zygote unless ``fork`` is false (default: unless
    ``PID_TEST_NO_FORKSERVER`` is set)."""
    return _run(code, None, args, cwd, env, timeout, fork)


def run_python_m(module: str, *args, cwd=None, env: dict[str, str] | None = None, timeout: float | None = None,
                 fork: bool | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *args], ...)`` as :func:`run_python_c` (the child runs the
    module with runpy as ``-m`` does: ``sys.path[0]`` the cwd, ``sys.argv[0]`` the module's file)."""
    return _run(None, module, args, cwd, env, timeout, fork)


def run_python_script(script, *args, cwd=None, env: dict[str, str] | None = None, timeout: float | None = None,
                      fork: bool | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], ...)`` as :func:`run_python_c` (the child runs the file as
    the interpreter does: ``sys.argv[0]`` the path as given, ``sys.path[0]`` its folder, ``__file__`` set)."""
    return _run(None, None, args, cwd, env, timeout, fork, script=os.fspath(script))


def _run(code, module, args, cwd, env, timeout, fork, script=None) -> subprocess.CompletedProcess:
    if fork is None:
        fork = not DISABLED
    cwd = os.getcwd() if cwd is None else cwd
    if not fork:
        cmd = [sys.executable, *(["-m", module] if module else [script] if script else ["-c", code]),
               *map(str, args)]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    env = dict(os.environ if env is None else env)
    return zygote(env).run(code, cwd, env, timeout, args=args, module=module, script=script)


@atexit.register
def _close_all() -> None:
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()
