"""What the ahead-of-time tests (aot_test.py, capi_test.py, aot_gpu_test.py) share: running a
command, failing with its output, and the clean environment a compiled model runs in."""
import os
import re
import subprocess
import sys


def run(cmd, cwd=None, env=None, timeout=600):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def fail(message, *outputs):
    for o in outputs:
        print(o[-4000:])
    print("FAIL:", message)
    sys.exit(1)


def ok(cmd, **kw):
    rc, out, err = run(cmd, **kw)
    if rc != 0:
        fail("%s exited %d" % (" ".join(cmd), rc), out, err)
    return out, err


def refused(cmd, pattern, **kw):
    """`cmd` fails cleanly (a non-zero exit, not a signal) with a message matching `pattern`."""
    rc, out, err = run(cmd, **kw)
    if rc <= 0:  # negative: killed by a signal (a crash)
        fail("%s should fail cleanly, got %d" % (" ".join(cmd), rc), out, err)
    if not re.search(pattern, out + err):
        fail("%s: no message matching %r" % (" ".join(cmd), pattern), out, err)


def same_file(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def clean_env(home):
    """No KILN_* variables, no kernel cache, nothing of the source tree. OpenBLAS's own settings
    stay: they pick its kernels (OPENBLAS_CORETYPE), whose rounding differs, and kiln ran under them."""
    env = {"PATH": "/usr/bin:/bin", "HOME": home}
    env.update({k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")})
    return env
