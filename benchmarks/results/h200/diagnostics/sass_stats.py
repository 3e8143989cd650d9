"""Register count and instruction mix of the kernels the NVIDIA driver compiled for us.

The driver keeps compiled pipelines in its shader disk cache: run a product with
    __GL_SHADER_DISK_CACHE=1 __GL_SHADER_DISK_CACHE_SKIP_CLEANUP=1 __GL_SHADER_DISK_CACHE_PATH=/tmp/glc
bring the cache files back and run `python sass_stats.py FILE.bin ...` (needs the `zstd` tool
and CUDA's `nvdisasm`, NVDISASM=path; the device machine's copy runs here too; SASS_DIR=dir
keeps each kernel's disassembly).  Each cache entry is a zstd frame; the kernel entries start with
"NVDANVVMNVuc", hold the code's size and offset at 0x4c/0x50 and the register count 8 bytes
before the code.  The format is the driver's own (580.159 here) and undocumented: what this
reads is what was observed, for diagnosis only.
"""
import collections
import os
import re
import struct
import subprocess
import sys

NVDISASM = os.environ.get("NVDISASM", "/usr/local/cuda/bin/nvdisasm")


def kernels(path):
    data = open(path, "rb").read()
    starts = [m.start() for m in re.finditer(re.escape(b"\x28\xb5\x2f\xfd"), data)]
    for i, s in enumerate(starts):
        e = starts[i + 1] if i + 1 < len(starts) else len(data)
        raw = subprocess.run(["zstd", "-d", "-c"], input=data[s:e], capture_output=True).stdout
        if raw.startswith(b"NVDANVVMNVuc"):
            size, off = struct.unpack_from("<II", raw, 0x4C)
            yield raw[off - 8], raw[off + 8:off + 8 + size]


def main():
    for path in sys.argv[1:]:
        for j, (regs, code) in enumerate(kernels(path)):
            tmp = f"/tmp/sass_{os.getpid()}_{j}.bin"
            open(tmp, "wb").write(code)
            text = subprocess.run([NVDISASM, "-b", "SM90", tmp], capture_output=True, text=True).stdout
            os.remove(tmp)
            ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text)
            mix = collections.Counter(o.split(".")[0] for o in ops).most_common(10)
            print(f"{os.path.basename(path)} kernel {j}: {regs} registers, {len(ops)} instructions, {dict(mix)}")
            if os.environ.get("SASS_DIR"):   # keep the disassembly too
                open(os.path.join(os.environ["SASS_DIR"], f"{os.path.basename(path)}.{j}.sass"), "w").write(text)


if __name__ == "__main__":
    main()
