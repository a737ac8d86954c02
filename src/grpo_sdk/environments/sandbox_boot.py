"""The first process of a sandbox: isolates itself, then runs the snippet as its child.

Not imported by grpo-sdk: ``grpo_sdk.environments.sandbox`` runs this file as
``python -I -S -B sandbox_boot.py PAYLOAD_FD STATUS_FD REPORT_FD`` (standard library only, as the
trainer's user, in a session of its own, with a clean environment). docs/sandbox.md says what each
step guards against; in order:

1. Reads the job (JSON) from PAYLOAD_FD.
2. Enters new namespaces, each where the kernel allows it: user (only when not root: it is what
   lets an unprivileged user create the others), network (no interface but a down loopback), mount,
   PID, IPC and UTS. With ``network: required`` and no network namespace it runs nothing.
3. With the mount namespace: private, size-capped tmpfs on every world-writable directory (``/tmp``
   holds the working directory), empty read-only tmpfs over the hidden paths (the interpreter's
   own directories bound back, read-only), and ``/`` remounted read-only.
4. Forks the sandbox's init: PID 1 of the new PID namespace (when there is one: when it exits,
   the kernel kills every process left in it). It mounts a ``/proc`` that shows only the sandbox
   (and reports whether it could),
   writes the snippet into its working directory and forks the snippet, which sets the resource
   limits, switches to the sandbox uid (when root), forbids privilege gains and execs
   ``python -I -B -c HARNESS``. The init reaps orphans and writes the snippet's exit status and
   CPU time to STATUS_FD.
5. Waits for the init. An alarm bounds this process's life, and each process of the sandbox dies
   with its parent (PR_SET_PDEATHSIG), so a sandbox whose trainer died goes within seconds of its
   timeout.
"""

import ctypes
import fcntl
import json
import os
import resource
import signal
import stat
import sys

CLONE = {"user": 0x10000000, "net": 0x40000000, "mount": 0x00020000, "pid": 0x20000000,
         "ipc": 0x08000000, "uts": 0x04000000}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# statvfs flags -> the mount flags a bind remount must keep (a user namespace may not drop them)
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, 0x400), (os.ST_NODIRATIME, 0x800), (os.ST_RELATIME, 0x200000))
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
WORKDIR = "/tmp/sandbox"  # inside the private /tmp

libc = ctypes.CDLL(None, use_errno=True)

HARNESS = r'''
import builtins, json, os, sys, traceback
_write, _exit, _getpid = os.write, os._exit, os.getpid
_PID = _getpid()

def _send(record):
    if _getpid() == _PID:  # a child the code forked runs on through this harness: it reports nothing
        _write(3, (json.dumps(record) + "\n").encode())

def _error(exc):
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return {"type": type(exc).__name__, "message": text[-400:], "errno": getattr(exc, "errno", None)}

def _finish():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    _exit(0)  # atexit handlers the code registered do not run

with open("tests.json", encoding="utf-8") as f:
    _tests = json.load(f)
os.remove("tests.json")  # the code runs first: it must not read the tests and echo their answers
with open("solution.py", encoding="utf-8") as f:
    _source = f.read()
_namespace = {"__name__": "solution", "__file__": "solution.py", "__builtins__": builtins}
_send({"event": "start", "tests": len(_tests)})
try:
    exec(compile(_source, "solution.py", "exec"), _namespace)
except BaseException as exc:  # SystemExit too: code that exits has not passed
    _send({"event": "code", "ok": False, "error": _error(exc)})
    _finish()
_send({"event": "code", "ok": True})
for _i, _test in enumerate(_tests):
    try:
        exec(compile(_test, f"test_{_i}", "exec"), _namespace)
        _send({"event": "test", "index": _i, "ok": True})
    except BaseException as exc:
        _send({"event": "test", "index": _i, "ok": False, "error": _error(exc)})
_send({"event": "done"})
_finish()
'''


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source, target, fstype, flags, data=None):
    enc = (lambda s: s.encode() if s is not None else None)
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def kept_flags(path):
    have = os.statvfs(path).f_flag
    return sum(ms for st, ms in KEPT_FLAGS if have & st)


def unshare(job, root):
    """Enter what namespaces the kernel allows; returns (entered, {name: why not})."""
    entered, missing = [], {}
    names = ["net"] if job["network"] != "off" else []
    names += ["mount", "pid", "ipc", "uts"]
    if not root:  # an unprivileged user gets the others only inside a user namespace of its own
        uid, gid = os.getuid(), os.getgid()
        try:
            _check(libc.unshare(CLONE["user"]), "unshare(CLONE_NEWUSER)")
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            entered.append("user")
        except OSError as exc:
            missing["user"] = str(exc)
    for name in names:
        try:
            _check(libc.unshare(CLONE[name]), f"unshare(CLONE_NEW{name.upper()})")
            entered.append(name)
        except OSError as exc:
            missing[name] = str(exc)
    return entered, missing


def under(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def isolate_files(job, entered, missing):
    """The mount namespace's view: private scratch, hidden paths, a read-only root."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    hidden = [p for p in job["hidden_paths"] if os.path.isdir(p)]
    # A scratch directory under a hidden one (/run/lock under /run) is gone with it.
    scratch = [p for p in WORLD_WRITABLE if os.path.isdir(p) and not os.path.islink(p) and not under(p, hidden)]
    # Opened before anything is mounted over them: the bind mounts below come from these handles. An
    # interpreter under a hidden path (~/.pyenv) or a scratch one (a venv in /tmp) is bound back.
    exposed = [(p, os.open(p, os.O_PATH)) for p in job["exposed_paths"]
               if os.path.isdir(p) and under(p, hidden + scratch)]
    for path in hidden:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    for path in scratch:
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['disk_mb']}m,mode=1777")
    for path, fd in exposed:
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept_flags(path))
        os.close(fd)
    for path in hidden:
        mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    try:
        mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept_flags("/"))
        entered.append("readonly_root")
    except OSError as exc:
        missing["readonly_root"] = str(exc)


def limit(job, uid, entered):
    mb = 1 << 20
    limits = [(resource.RLIMIT_CPU, job["cpu_s"], job["cpu_s"] + 1),  # SIGXCPU, then SIGKILL a second later
              (resource.RLIMIT_AS, job["memory_mb"] * mb, job["memory_mb"] * mb),
              (resource.RLIMIT_FSIZE, job["file_size_mb"] * mb, job["file_size_mb"] * mb),
              (resource.RLIMIT_NOFILE, job["max_open_files"], job["max_open_files"]),
              (resource.RLIMIT_CORE, 0, 0)]
    if uid is not None or "user" in entered:
        # RLIMIT_NPROC counts the processes of a uid (in a user namespace, of that namespace's uid):
        # meaningful only for a uid of the sandbox's own, and root is exempt from it.
        limits.append((resource.RLIMIT_NPROC, job["max_processes"], job["max_processes"]))
    for which, soft, hard in limits:
        resource.setrlimit(which, (soft, hard))


def init(job, entered, status, report_fd):
    """PID 1 of the sandbox (when there is a PID namespace): prepares the files, starts the snippet
    as its child, reaps every orphan, and writes the snippet's end to the status pipe. Being PID 1
    itself would leave the snippet immune to the signals of its limits (SIGXCPU) and to its own."""
    if "pid" in entered and "mount" in entered:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            status.write(json.dumps({"proc": None}) + "\n")
        except OSError as exc:  # a user namespace may not mount proc where the host's is partly masked
            status.write(json.dumps({"proc": str(exc)}) + "\n")
    if "uts" in entered:
        libc.sethostname(b"sandbox", 7)
    workdir = WORKDIR if "mount" in entered else job["host_workdir"]
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    for name, text in (("solution.py", job["code"]), ("tests.json", json.dumps(job["tests"]))):
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(text)
    uid = job["uid"]
    if uid is not None:
        for path in (workdir, *(os.path.join(workdir, n) for n in os.listdir(workdir))):
            os.chown(path, uid, uid)
    # Dies with the bootstrap, which the trainer kills at the deadline; in a PID namespace the
    # kernel then kills everything left in it.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    snippet = os.fork()
    if snippet == 0:
        try:
            become_snippet(job, entered, workdir, report_fd)  # closes the status pipe as it execs
        except BaseException as exc:  # noqa: BLE001 - anything before the exec is the sandbox's failure
            try:
                status.write(json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}) + "\n")
            finally:
                os._exit(121)
    os.close(report_fd)
    while True:
        pid, wait_status, usage = os.wait4(-1, 0)
        if pid == snippet:
            break
    record = {"cpu_s": usage.ru_utime + usage.ru_stime}
    if os.WIFSIGNALED(wait_status):
        record["signal"] = os.WTERMSIG(wait_status)
    else:
        record["exit"] = os.WEXITSTATUS(wait_status)
    status.write(json.dumps(record) + "\n")


def become_snippet(job, entered, workdir, report_fd):
    os.chdir(workdir)
    uid = job["uid"]
    limit(job, uid, entered)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from root: every capability goes too
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    # After the uid switch, which would clear it: the snippet dies with the sandbox's init.
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if report_fd != 3:
        os.dup2(report_fd, 3)
    os.set_inheritable(3, True)
    for fd in map(int, os.listdir("/proc/self/fd")):  # close-on-exec, not closed: a failed exec still reports
        if fd > 3:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass
    env = dict(job["env"], HOME=workdir, TMPDIR=workdir)
    python = job["python"]
    try:
        os.execve(python, [python, "-I", "-B", "-c", HARNESS], env)
    except OSError as exc:
        who = "the sandbox's uid" if uid is not None else "the sandbox"
        raise OSError(exc.errno, f"{who} cannot run {python}: {exc.strerror} (a directory on its path is not "
                      "readable by that uid, or is hidden)") from None


def main():
    os.umask(0o022)
    # Moved clear of fd 3, which the snippet's report channel takes.
    given = [int(a) for a in sys.argv[1:4]]
    payload_fd, status_fd, report_fd = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in given)
    for fd in given:
        os.close(fd)
    with os.fdopen(payload_fd, "rb") as f:
        job = json.loads(f.read())
    status = os.fdopen(status_fd, "w", buffering=1)
    signal.alarm(int(job["timeout_s"]) + 5)  # this process outlives its trainer by seconds at most
    job["root"] = os.geteuid() == 0
    entered, missing = unshare(job, job["root"])
    if "mount" in entered:
        try:
            isolate_files(job, entered, missing)
        except OSError as exc:
            status.write(json.dumps({"setup_error": f"isolating the file system: {exc}"}) + "\n")
            return
    status.write(json.dumps({"layers": entered, "missing": missing}) + "\n")
    if job["network"] == "required" and "net" not in entered:
        status.write(json.dumps({"setup_error": f"no network namespace: {missing.get('net')}"}) + "\n")
        return
    pid = os.fork()
    if pid == 0:
        try:
            init(job, entered, status, report_fd)
        except BaseException as exc:  # noqa: BLE001 - before the snippet started: the sandbox's failure
            status.write(json.dumps({"setup_error": f"{type(exc).__name__}: {exc}"}) + "\n")
        os._exit(0)
    os.close(report_fd)  # the parent sees the report's end when the snippet's side closes too
    status.close()
    os.waitpid(pid, 0)
    os._exit(0)  # the trainer waits for this process's stdout to close: skip the interpreter's teardown


if __name__ == "__main__":
    main()
