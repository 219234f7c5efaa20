"""The stage libraries (libattn_<stage>.so, built from common/stage_library.cu) seen from
ctypes: the C structures of common/attention.h mirrored field for field, and a loader.

Where the libraries are looked for, first match wins:
  1. the folder in the environment variable FLASH_STAGES_LIB_DIR;
  2. flash_stages/lib inside the package (what `cmake --build build --target python_package`
     fills, and what `pip install ./python` then installs);
  3. build/lib, build-dev/lib and build-gpu/lib of the repository the package sits in (a
     checkout used in place, without installing; not looked at for an installed package).
"""
import ctypes
import glob
import os

# attn_dtype in common/attention.h.
DTYPE_FP32, DTYPE_FP16, DTYPE_BF16 = 0, 1, 2


class Problem(ctypes.Structure):
    """attn_problem. heads_kv 0 means H; cache_lens NULL means every sequence holds Nkv keys
    (flash_attn_with_kvcache passes B host ints); layout 0 is [B, H, N, d] (LAYOUT_BHND), 1
    [B, N, H, d] (the C++ operators pass that where the stage has layouts). The window, softcap
    and varlen fields (13_window_softcap_varlen) are 0 but in the calls that ask for them
    (flash_attn_func's window_size and softcap, flash_attn_varlen_func), which leave the host
    cu_seqlens NULL: the library reads the device copies in Buffers and plans its grids from
    max_seqlen_q and max_seqlen_k."""
    _fields_ = [("batch", ctypes.c_int), ("heads", ctypes.c_int), ("seq_q", ctypes.c_int),
                ("seq_kv", ctypes.c_int), ("head_dim", ctypes.c_int), ("causal", ctypes.c_int),
                ("scale", ctypes.c_float), ("dtype", ctypes.c_int), ("heads_kv", ctypes.c_int),
                ("cache_lens", ctypes.c_void_p), ("layout", ctypes.c_int),
                ("windowed", ctypes.c_int), ("window_left", ctypes.c_int),
                ("window_right", ctypes.c_int), ("softcap", ctypes.c_float),
                ("seqs", ctypes.c_int), ("max_seqlen_q", ctypes.c_int),
                ("max_seqlen_k", ctypes.c_int), ("cu_seqlens_q", ctypes.c_void_p),
                ("cu_seqlens_k", ctypes.c_void_p)]


class Buffers(ctypes.Structure):
    """attn_buffers: device pointers, PyTorch's own storage."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("o", ctypes.c_void_p), ("lse", ctypes.c_void_p), ("d_o", ctypes.c_void_p),
                ("dq", ctypes.c_void_p), ("dk", ctypes.c_void_p), ("dv", ctypes.c_void_p),
                ("workspace", ctypes.c_void_p), ("cache_lens", ctypes.c_void_p),
                ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p)]


class Stage(ctypes.Structure):
    """attn_stage: only the fields Python reads are used, but every field is declared so that
    the offsets match the C layout."""
    _fields_ = [("name", ctypes.c_char_p), ("idea", ctypes.c_char_p),
                ("device", ctypes.c_void_p), ("head_dims", ctypes.c_int * 8),
                ("dtypes", ctypes.c_uint), ("has_causal", ctypes.c_int),
                ("saves_lse", ctypes.c_int), ("forward_workspace", ctypes.c_void_p),
                ("forward", ctypes.c_void_p), ("backward_workspace", ctypes.c_void_p),
                ("backward", ctypes.c_void_p), ("has_gqa", ctypes.c_int),
                ("has_cache_lens", ctypes.c_int), ("has_gqa_backward", ctypes.c_int),
                ("has_layouts", ctypes.c_int), ("has_window", ctypes.c_int),
                ("has_softcap", ctypes.c_int), ("has_varlen", ctypes.c_int)]


class StageLibraryError(RuntimeError):
    """A call that the stage program would have ended with `code` (its exit status): 2 for
    what this device cannot run, 77 for a stage built for another GPU, 1 for a CUDA error.
    The message is the program's line."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


# The entry points' version this package calls (attn_library_abi in common/stage_library.cu).
LIBRARY_ABI = 6


class StageLibrary:
    """One loaded stage: its descriptor's facts and its entry points."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        abi = getattr(self.lib, "attn_library_abi", None)  # None: built before it existed
        if abi is None or abi() != LIBRARY_ABI:
            raise ImportError(f"{path} was built from an older common/stage_library.cu; rebuild "
                              "the libraries: cmake --build build --target python_package")
        self.lib.attn_library_stage.restype = ctypes.POINTER(Stage)
        for fn in ("attn_library_forward_workspace", "attn_library_backward_workspace"):
            getattr(self.lib, fn).restype = ctypes.c_int
            getattr(self.lib, fn).argtypes = [ctypes.POINTER(Problem),
                                              ctypes.POINTER(ctypes.c_size_t)]
        self.lib.attn_library_error.restype = ctypes.c_char_p
        passes = {"attn_library_forward": [], "attn_library_backward": [ctypes.c_int]}
        for fn, extra in passes.items():  # the backward's extra: deterministic
            getattr(self.lib, fn).restype = ctypes.c_int
            getattr(self.lib, fn).argtypes = [ctypes.POINTER(Problem), ctypes.POINTER(Buffers),
                                              ctypes.c_void_p, *extra]
        s = self.lib.attn_library_stage().contents
        self.name = s.name.decode()
        self.idea = s.idea.decode()
        self.head_dims = tuple(d for d in s.head_dims if d)  # empty: any d >= 1
        mask = s.dtypes or 1 << DTYPE_FP32  # 0 means fp32 only
        self.dtype_codes = tuple(t for t in (DTYPE_FP32, DTYPE_FP16, DTYPE_BF16)
                                 if mask & (1 << t))
        self.causal = bool(s.has_causal)
        self.backward = bool(s.backward)
        self.gqa = bool(s.has_gqa)
        self.gqa_backward = bool(s.has_gqa_backward)
        self.cache_lens = bool(s.has_cache_lens)
        self.layouts = bool(s.has_layouts)
        self.window = bool(s.has_window)
        self.softcap = bool(s.has_softcap)
        self.varlen = bool(s.has_varlen)

    def entry_points(self):
        """The addresses of the forward and backward workspace, forward, backward and error
        entry points, in that order, for the C++ operators (flash_stages::register_stage)."""
        return tuple(ctypes.cast(getattr(self.lib, fn), ctypes.c_void_p).value for fn in (
            "attn_library_forward_workspace", "attn_library_backward_workspace",
            "attn_library_forward", "attn_library_backward", "attn_library_error"))

    def error(self):
        """The line of this thread's last failed call, as the stage program would print it."""
        return self.lib.attn_library_error().decode(errors="replace")

    def _checked(self, code, what):
        if code != 0:
            raise StageLibraryError(code, f"{self.error()} (in the {what})")

    def forward_workspace(self, problem):
        """Bytes of device workspace the forward needs (stage 11 plans its decode split from
        the current device)."""
        size = ctypes.c_size_t()
        self._checked(self.lib.attn_library_forward_workspace(ctypes.byref(problem),
                                                               ctypes.byref(size)),
                      "forward workspace")
        return size.value

    def backward_workspace(self, problem):
        size = ctypes.c_size_t()
        self._checked(self.lib.attn_library_backward_workspace(ctypes.byref(problem),
                                                                ctypes.byref(size)),
                      "backward workspace")
        return size.value

    def forward(self, problem, buffers, stream):
        """stream: a cudaStream_t as an integer (torch.cuda.Stream.cuda_stream)."""
        self._checked(self.lib.attn_library_forward(ctypes.byref(problem), ctypes.byref(buffers),
                                                    stream), "forward")

    def run_backward(self, problem, buffers, stream, deterministic=False):
        """deterministic: the stage's deterministic path, as ATTN_DETERMINISTIC=1 gives."""
        self._checked(self.lib.attn_library_backward(ctypes.byref(problem), ctypes.byref(buffers),
                                                     stream, int(deterministic)),
                      "backward")


def library_dirs():
    """The folders looked in, in order: only real candidates, so that a message listing them
    names places that can hold the libraries."""
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    dirs = []
    if os.environ.get("FLASH_STAGES_LIB_DIR"):
        dirs.append(os.environ["FLASH_STAGES_LIB_DIR"])
    dirs.append(os.path.join(here, "lib"))
    # The repository's build folders, where the package is the checkout's python/flash_stages
    # (an installed copy in site-packages has no repository around it).
    if os.path.exists(os.path.join(root, "CMakePresets.json")):
        dirs += [os.path.join(root, b, "lib") for b in ("build", "build-dev", "build-gpu")]
    return dirs


def load_all():
    """{stage name: StageLibrary} from the first folder that holds any library, and that
    folder (None when there is none)."""
    for d in library_dirs():
        paths = sorted(glob.glob(os.path.join(d, "libattn_*.so")))
        if paths:
            libs = [StageLibrary(p) for p in paths]
            return {lib.name: lib for lib in libs}, d
    return {}, None
