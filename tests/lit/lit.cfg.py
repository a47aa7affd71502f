# lit configuration for Kiln's FileCheck tests. Run through ctest (`ctest -R '^lit$'`) or
# directly: python3 /usr/lib/llvm-14/build/utils/lit/lit.py -sv <build>/tests/lit
#
# In RUN lines: %kiln is the built binary, FileCheck and not come from llvm-14, %s is the test
# file, %t a scratch path. Tests live in any subfolder: passes/, opt/, frontend/, ...
import os

import lit.formats

config.name = "kiln"
config.test_format = lit.formats.ShTest(execute_external=True)
config.suffixes = [".mlir", ".kiln"]
config.excludes = ["Inputs", "CMakeLists.txt", "lit.cfg.py", "lit.site.cfg.py.in"]

if not hasattr(config, "kiln_binary"):
    lit_config.fatal("run lit on the build folder (<build>/tests/lit), whose lit.site.cfg.py names kiln")

config.test_source_root = config.kiln_lit_source_dir
config.test_exec_root = config.kiln_lit_exec_dir

config.substitutions.append(("%kiln", config.kiln_binary))
# Whole words only, so that `FileCheck` in a path or `not` inside a word stay as they are.
config.substitutions.append((r"(?<![\w/.-])FileCheck(?![\w.-])", os.path.join(config.llvm_tools_dir, "FileCheck")))
config.substitutions.append((r"(?<![\w/.-])not(?![\w.-])", os.path.join(config.llvm_tools_dir, "not")))

config.environment["PATH"] = os.pathsep.join([config.llvm_tools_dir, os.environ.get("PATH", "")])

# `REQUIRES: nvrtc`: tests that compile the generated CUDA (no GPU needed) run where NVRTC loads,
# from the loader's path or the CUDA toolkit's usual folder, as kiln itself finds it.
def _nvrtc_loads():
    import ctypes
    import glob
    names = ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    names += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")) + sorted(glob.glob("/usr/local/cuda/lib/libnvrtc.so*"))
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


if _nvrtc_loads():
    config.available_features.add("nvrtc")
