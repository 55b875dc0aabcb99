"""``import llama_cpp`` before ``clover_cpp``: llama-cpp-python then loads clover's libllama too.

llama-cpp-python reads ``LLAMA_CPP_LIB_PATH`` once, when ``llama_cpp`` is first imported, and
importing ``clover_cpp`` sets it (``clover_cpp._lib``). clover-cpp installs this module and
``_clover_cpp_llama.pth`` (which imports it at interpreter start) beside its packages: the
finder below imports ``clover_cpp`` just before ``llama_cpp``'s first import, then leaves. At
start-up it only registers itself, as every Python of the environment runs it.
"""

import os
import sys


class _ImportCloverFirst:
    """A meta path finder that finds nothing: on the import of ``llama_cpp`` it imports
    ``clover_cpp`` first (once)."""

    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp":
            sys.meta_path.remove(self)
            if "LLAMA_CPP_LIB_PATH" not in os.environ and "clover_cpp" not in sys.modules:
                try:
                    import clover_cpp  # noqa: F401
                except Exception:  # noqa: BLE001 - a broken clover-cpp must not break llama_cpp's import
                    return None
                import importlib.util

                return importlib.util.find_spec(name)  # through the finder clover_cpp has just put first
        return None


sys.meta_path.insert(0, _ImportCloverFirst())
