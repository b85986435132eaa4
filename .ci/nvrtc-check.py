"""Compiles ndscope's kernels exactly as the CUDA backend does at run time, with NVIDIA's NVRTC, and
assembles the PTX with ptxas: no GPU is needed.

    python3 .ci/nvrtc-check.py TOOLS_DIR

TOOLS_DIR holds the wheels nvidia-cuda-nvrtc-cu12 and nvidia-cuda-nvcc-cu12 (pip install --target);
.ci/check-kernels installs them. The source is the kernel files concatenated in the order
src/backend/cuda/kernels.rs gives them (`SOURCES.concat()`), compiled under the name ndscope.cu with
only the architecture option (what `cudarc::nvrtc::compile_ptx_with_opts` passes for ndscope's
`CompileOptions`), for compute_80 and compute_90. Then:

- ptxas -arch=sm_80 / sm_90 assembles each PTX; any error fails, and the registers and spills of
  every kernel that spills are printed (a spill fails the check: the kernels are written not to);
- every kernel name the Rust side can ask for (each `family!` gives five dtype instances,
  `float_family!` four, `cast_kernel` the 5 x 5 conversions) must be an entry of the PTX;
- each kernel file compiles after common.cuh alone, so no file depends on its place in the order.
"""
import ctypes
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARCHS = ("80", "90")
DTYPES = ("f32", "f64", "i64", "bf16", "f16")
FLOATS = ("f32", "f64", "bf16", "f16")


def sources():
    rust = (ROOT / "src/backend/cuda/kernels.rs").read_text()
    files = re.findall(r'include_str!\("\.\./\.\./\.\./kernels/([^"]+)"\)', rust)
    if not files or files[0] != "common.cuh":
        sys.exit("nvrtc-check: kernels.rs must list common.cuh first")
    return [(f, (ROOT / "kernels" / f).read_text()) for f in files]


class Nvrtc:
    def __init__(self, tools):
        lib = pathlib.Path(tools) / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
        self.lib = ctypes.CDLL(str(lib))
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def compile(self, source, arch):
        """PTX of `source` for compute_`arch`, or raises with NVRTC's log."""
        prog = ctypes.c_void_p()
        rc = self.lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), b"ndscope.cu", 0, None, None
        )
        self.check(rc, "nvrtcCreateProgram")
        opts = [f"--gpu-architecture=compute_{arch}".encode()]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        rc = self.lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
            raise RuntimeError(log.value.decode(errors="replace"))
        self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        self.check(self.lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return ptx.value.decode(), log.value.decode(errors="replace").strip()

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")


def requested_kernels():
    """Every kernel name the Rust side can look up."""
    names = set()
    for path in (ROOT / "src/backend/cuda").glob("*.rs"):
        text = path.read_text()
        for base in re.findall(r'(?<!float_)family!\("([a-z0-9_]+)"\)', text):
            if base.startswith("cast_"):
                continue  # the conversions are listed below
            names.update(f"{base}_{d}" for d in DTYPES)
        for base in re.findall(r'float_family!\("([a-z0-9_]+)"\)', text):
            names.update(f"{base}_{d}" for d in FLOATS)
    names.update(f"cast_{a}_{b}" for a in DTYPES for b in DTYPES)
    # The quantized products' kernels are named one by one (src/backend/cuda/quant.rs).
    names.update(re.findall(r'"(quant_[a-z0-9_]+)"', (ROOT / "src/backend/cuda/quant.rs").read_text()))
    # So are the tiled attention kernels (src/backend/cuda/attention.rs).
    names.update(
        re.findall(r'"(attention_tiled_[a-z0-9_]+)"', (ROOT / "src/backend/cuda/attention.rs").read_text())
    )
    return names


def ptxas(tools, ptx, arch):
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "ndscope.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [str(pathlib.Path(tools) / "nvidia/cuda_nvcc/bin/ptxas"), f"-arch=sm_{arch}", "-v",
             "-o", str(pathlib.Path(tmp) / "ndscope.cubin"), str(src)],
            capture_output=True, text=True,
        )
    if out.returncode != 0:
        sys.exit(f"ptxas sm_{arch} refused the PTX:\n{out.stderr}")
    spills = []
    kernel = None
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and (int(m.group(1)) or int(m.group(2))):
            spills.append(f"{kernel}: {line.strip()}")
    return spills


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    tools = sys.argv[1]
    nvrtc = Nvrtc(tools)
    files = sources()
    whole = "".join(text for _, text in files)
    wanted = requested_kernels()
    failed = False
    for arch in ARCHS:
        try:
            ptx, log = nvrtc.compile(whole, arch)
        except RuntimeError as e:
            sys.exit(f"NVRTC {nvrtc.version} refused the kernels for compute_{arch}:\n{e}")
        if log:
            print(f"NVRTC compute_{arch} says:\n{log}")
        entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
        missing = sorted(wanted - entries)
        if missing:
            print(f"kernels the Rust side can ask for but compute_{arch} has not: {missing}")
            failed = True
        spills = ptxas(tools, ptx, arch)
        for s in spills:
            print(f"sm_{arch} spills: {s}")
        failed |= bool(spills)
        print(f"kernels: NVRTC {nvrtc.version} compute_{arch} and ptxas sm_{arch}: "
              f"{len(entries)} kernels, {len(spills)} spilling")
    common = files[0][1]
    for name, text in files[1:]:
        try:
            nvrtc.compile(common + text, ARCHS[0])
        except RuntimeError as e:
            print(f"kernels/{name} does not compile after common.cuh alone:\n{e}")
            failed = True
    if failed:
        sys.exit(1)
    print(f"kernels: each of {len(files) - 1} files compiles after common.cuh alone")


if __name__ == "__main__":
    main()
