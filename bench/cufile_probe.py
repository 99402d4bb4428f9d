#!/usr/bin/env python3
"""Why cuFile refuses a file on this machine: which file systems and open flags cuFileHandleRegister
accepts, with and without CUFILE_PARAM_FORCE_COMPAT_MODE (issue 17: ferrograd's file reads fell back
to pinned double buffers after `cuFileHandleRegister: error 5027`, CU_FILE_HANDLE_NOT_REGISTERED).

    python3 bench/cufile_probe.py [DIR ...]     (default: /tmp, the working directory, /dev/shm)

Prints the file system type of each directory and, per (directory, O_DIRECT or not), the status of
cuFileHandleRegister and of a 1 MiB cuFileRead into device memory. Needs libcufile and a GPU
(torch allocates the device buffer).
"""
import ctypes
import os
import subprocess
import sys

import torch


class Err(ctypes.Structure):
    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]


class Descr(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("fd", ctypes.c_int64), ("fs_ops", ctypes.c_void_p)]


def main():
    dirs = sys.argv[1:] or ["/tmp", os.getcwd(), "/dev/shm"]
    lib = ctypes.CDLL("libcufile.so.0")
    for f in ["cuFileDriverOpen", "cuFileHandleRegister", "cuFileSetParameterBool"]:
        if hasattr(lib, f):
            getattr(lib, f).restype = Err
    lib.cuFileRead.restype = ctypes.c_ssize_t
    lib.cuFileRead.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int64]
    torch.zeros(1, device="cuda")  # a CUDA context, current on this thread
    buf = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    if os.path.exists("/etc/cufile.json"):
        lines = [ln.strip() for ln in open("/etc/cufile.json") if "compat" in ln and not ln.strip().startswith("//")]
        print("/etc/cufile.json:", "; ".join(lines) or "(no compat keys)")
    print("nvidia-fs loaded:", os.path.exists("/proc/driver/nvidia-fs"))
    for force in [False, True]:
        if force:
            if not hasattr(lib, "cuFileSetParameterBool"):
                print("no cuFileSetParameterBool")
                break
            e = lib.cuFileSetParameterBool(2, ctypes.c_bool(True))  # CUFILE_PARAM_FORCE_COMPAT_MODE
            print(f"\ncuFileSetParameterBool(FORCE_COMPAT_MODE, true): {e.err}")
        e = lib.cuFileDriverOpen()
        print(f"cuFileDriverOpen: {e.err} (CUDA {e.cu_err})")
        for d in dirs:
            fs = subprocess.run(["stat", "-f", "-c", "%T", d], capture_output=True, text=True).stdout.strip()
            path = os.path.join(d, f"cufile_probe_{os.getpid()}.bin")
            with open(path, "wb") as fh:
                fh.write(os.urandom(1 << 20))
            for direct in [True, False]:
                try:
                    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
                except OSError as ex:
                    print(f"{d} ({fs}) O_DIRECT={direct}: open failed: {ex}")
                    continue
                h = ctypes.c_void_p()
                desc = Descr(1, fd, None)
                e = lib.cuFileHandleRegister(ctypes.byref(h), ctypes.byref(desc))
                n = lib.cuFileRead(h, ctypes.c_void_p(buf.data_ptr()), 1 << 20, 0, 0) if e.err == 0 else None
                ok = n == (1 << 20) and bytes(buf.cpu().numpy()) == open(path, "rb").read()
                print(f"{d} ({fs}) O_DIRECT={direct}: register {e.err} (CUDA {e.cu_err}), read {n}, bytes equal {ok}")
                if e.err == 0:
                    lib.cuFileHandleDeregister(h)
                os.close(fd)
            os.unlink(path)


if __name__ == "__main__":
    main()
