"""Compiled kernels that travel: Triton's cache entries of recorded launches, packed per GPU architecture.

Triton compiles each kernel once per machine into its cache folder (``TRITON_CACHE_DIR``, default
``~/.triton/cache``), keyed by a hash of the kernel's source, Triton's version, the target architecture, the
ptxas version and the compile options. That folder can be copied to another machine as it is. A bundle is the
useful part of it in one file: for each recorded launch signature (see ``precompile_recorded``), the files
Triton reads on a cache hit (the kernel's metadata and its cubin), plus the small host modules Triton builds
with the C compiler (the launchers, one per argument signature, and ``cuda_utils``).

- :func:`export` writes a bundle of this machine's compiled kernels; :func:`install` copies a bundle's entries
  into the cache folder (entries already there are left alone).
- One bundle serves every GPU model of its architecture (the H100 and the H200 are both ``sm_90``): an export
  with ``merge`` adds this model's kernels to those already in the file, and the manifest lists, per GPU model,
  the launches recorded and compiled on it (``models``), since the tuned configs, and so the kernels, of one
  launch may differ between models.
- The package ships bundles in ``runtime/compiled/``; :func:`ensure_shipped` installs the one made for this GPU
  before the process's first compile on it. A bundle is used only where its architecture (``sm_90``), Triton
  version and CUDA driver version equal this machine's; inside it, an entry of an edited kernel is never
  found, because Triton's hash of the new source differs.
"""

import datetime
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import threading

import torch
import triton

from dflash_kernels.runtime import settings, tuning

__all__ = ["bundle_key", "bundle_name", "gpu_model", "export", "install", "ensure_shipped", "installed_signatures",
           "model_signatures"]

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compiled")
MANIFEST = "MANIFEST.json"
FORMAT = 2  # 2: per-model entries under "models"; 1: one model, its "gpu", "run" and "signatures" at the top


def model_signatures(manifest: dict, gpu: str) -> list:
    """The persist names of the launches whose kernels ``manifest``'s bundle holds for GPU model ``gpu`` (the
    device name, as ``torch.cuda.get_device_name`` gives it); none for a model it was not made on."""
    return list(_models(manifest).get(gpu, {}).get("signatures", ()))


def _driver_cuda() -> str:
    """The CUDA version of the installed driver, ``"13.0"``; ``""`` when it cannot be read."""
    import ctypes

    try:
        v = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) != 0:
            return ""
        v = v.value
    except OSError:  # no driver library: an unknown driver matches no bundle
        return ""
    return f"{v // 1000}.{(v % 1000) // 10}" if v > 0 else ""


def bundle_key(device) -> dict:
    """What a bundle must match to be used on ``device``: architecture, Triton version, the driver's CUDA version."""
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return {"arch": f"sm_{major}{minor}", "triton": triton.__version__, "cuda_driver": _driver_cuda()}


def gpu_model(device) -> str:
    """The GPU model a bundle's per-model entries are keyed by: the device name (``NVIDIA H100 80GB HBM3``)."""
    return torch.cuda.get_device_name(torch.device(device))


def bundle_name(key: dict) -> str:
    return f"kernels-{key['arch'].replace('_', '')}-triton{key['triton']}-cuda{key['cuda_driver']}.tar.xz"


def _cache_root() -> str:
    from triton import knobs

    return knobs.cache.dir


def recorded_launches(device, tags=None) -> tuple:
    """``(recorded, current)``: how many launches are recorded for ``device``'s GPU model (with ``tags``, only
    those recorded under one of them), and ``{persist name: signature}`` of those whose kernel source is
    current (the others can never be found again)."""
    from dflash_kernels.runtime.kernel import all_kernels

    hashes = {k.name: k._source_hash for k in all_kernels()}
    recorded = tuning.store().entries(device, tuning.SIGNATURE_PREFIX)
    if tags:
        recorded = {n: v for n, v in recorded.items() if set(tags) & set(v.get("tags", ()))}
    current = {}
    for name, sig in recorded.items():
        persist = name[len(tuning.SIGNATURE_PREFIX):]
        kernel, _, rest = persist.partition("|")
        if hashes.get(kernel) == rest.partition("|")[0]:
            current[persist] = sig
    return len(recorded), current


def export(path: str, device=None, tags=None, run: str = None, merge: bool = False) -> dict:
    """Write a bundle of the compiled kernels of every recorded launch of this GPU model (of the current kernel
    sources; with ``tags``, only those recorded under one of them) to ``path``: the configs the tuning store
    holds for each (compiling any that is missing), and every host module in Triton's cache folder.

    ``merge``: where ``path`` already holds a bundle for this machine's key, keep its files and its other GPU
    models' entries, and replace this model's (a bundle for another key is replaced whole).

    Returns the manifest written."""
    import dflash_kernels  # noqa: F401 - defines every op's kernels
    from dflash_kernels.runtime.kernel import all_kernels

    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    kernels = {k.name: k for k in all_kernels()}
    files = {}  # archive path -> bytes
    covered = []
    for persist, sig in sorted(recorded_launches(index, tags)[1].items()):
        kernel = kernels[persist.partition("|")[0]]
        compiled = kernel.compiled_for_signature(persist, sig, index)
        for ck in compiled:
            ck._init_handles()  # builds the launcher module into the cache folder if it is not there
            files.update(entry_files(ck))
        if compiled:
            covered.append(persist)
    root = _cache_root()
    for entry in sorted(os.listdir(root)):
        folder = os.path.join(root, entry)
        if not os.path.isdir(folder):
            continue
        names = [n for n in os.listdir(folder) if not n.startswith(".") and n != "lock"]
        if len(names) == 1 and names[0].endswith(".so"):  # a host module: a launcher, cuda_utils
            with open(os.path.join(folder, names[0]), "rb") as f:
                files[f"{entry}/{names[0]}"] = f.read()
    entry = dict(run=run, created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 tags=sorted(tags) if tags else None, kernels=sum(n.endswith(".cubin") for n in files),
                 signatures=covered)
    return write_bundle(path, bundle_key(dev), gpu_model(dev), entry, files, merge)


def write_bundle(path: str, key: dict, gpu: str, entry: dict, files: dict, merge: bool = False) -> dict:
    """Pack ``files`` as the bundle of machine ``key`` with ``entry`` (run, created, tags, kernels, signatures)
    for GPU model ``gpu``; with ``merge``, an existing bundle at ``path`` for the same key keeps its files and
    its other models' entries. Returns the manifest written."""
    models = {}
    if merge and os.path.exists(path):
        old_manifest, old_files = unpack(path)
        if all(old_manifest.get(k) == v for k, v in key.items()):
            models = _models(old_manifest)
            files = {**old_files, **files}
    models[gpu] = entry
    manifest = dict(key, format=FORMAT, python=sys.version.split()[0], kernels=sum(n.endswith(".cubin") for n in files),
                    host_modules=sum(n.endswith(".so") for n in files), models=dict(sorted(models.items())))
    pack(path, manifest, files)
    return manifest


def _models(manifest: dict) -> dict:
    """A manifest's per-model entries (a format-1 manifest's single model made one)."""
    if "models" in manifest:
        return dict(manifest["models"])
    return {manifest.get("gpu"): {n: manifest.get(n) for n in ("run", "created", "tags", "kernels", "signatures")}}


def unpack(path: str) -> tuple:
    """``(manifest, files)`` of a bundle, as :func:`pack` takes them."""
    with tarfile.open(path, "r:xz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    return json.loads(files.pop(MANIFEST)), files


def entry_files(compiled) -> dict:
    """``{"<cache entry>/<file>": bytes}``: what Triton reads on a cache hit of ``compiled`` (a
    ``CompiledKernel``): its metadata and its binary."""
    from triton.runtime.cache import get_cache_manager

    folder = get_cache_manager(compiled.hash).cache_dir
    entry = os.path.basename(folder)
    out = {}
    for suffix in (".json", ".cubin"):
        with open(os.path.join(folder, compiled.name + suffix), "rb") as f:
            out[f"{entry}/{compiled.name}{suffix}"] = f.read()
    return out


def pack(path: str, manifest: dict, files: dict) -> None:
    """Write a bundle: ``manifest`` and ``files`` (``{"<cache entry>/<file>": bytes}``), xz-compressed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode())] + sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)


def read_manifest(path: str) -> dict:
    with tarfile.open(path, "r:xz") as tar:
        return json.load(tar.extractfile(MANIFEST))


def install(path: str, device=None, force: bool = False, machine: dict = None) -> dict:
    """Copy ``path``'s entries into Triton's cache folder where they are not there yet.

    The bundle is used only when its architecture, Triton version and driver CUDA version equal ``device``'s
    (``force``: whatever they are; Triton's hashes still keep every entry from a kernel it does not match).
    ``machine``: this machine's :func:`bundle_key`, when already known.

    Returns ``{"installed", "present", "manifest", "skipped"}``: entries copied, entries found there already,
    and, when nothing was copied for a mismatch, why."""
    if machine is None:
        machine = bundle_key(torch.device("cuda", torch.cuda.current_device()) if device is None else device)
    with tarfile.open(path, "r:xz") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        manifest = json.load(tar.extractfile(members.pop(MANIFEST)))
        report = {"installed": 0, "present": 0, "manifest": manifest, "skipped": None}
        want = machine
        have = {k: manifest.get(k) for k in want}
        if have != want and not force:
            report["skipped"] = f"made for {have}, this machine is {want}"
            return report
        root = _cache_root()
        entries = {}
        for name in members:
            entry, _, file = name.partition("/")
            if "/" in file or entry in ("", ".", "..") or file in ("", ".", ".."):
                raise ValueError(f"path: {path!r} holds an unexpected member {name!r}")
            entries.setdefault(entry, []).append(file)
        for entry, names in sorted(entries.items()):
            folder = os.path.join(root, entry)
            kernel = [n for n in names if n.endswith(".json")]
            done = (os.path.exists(os.path.join(folder, "__grp__" + kernel[0])) if kernel
                    else all(os.path.exists(os.path.join(folder, n)) for n in names))
            if done:
                report["present"] += 1
                continue
            os.makedirs(folder, exist_ok=True)
            for n in names:
                _write(os.path.join(folder, n), tar.extractfile(members[f"{entry}/{n}"]).read())
            if kernel:  # the group file Triton looks up, written last, with this folder's paths
                group = {n: os.path.join(folder, n) for n in names}
                _write(os.path.join(folder, "__grp__" + kernel[0]), json.dumps({"child_paths": group}).encode())
            report["installed"] += 1
    return report


def _write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".dk-", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


_lock = threading.Lock()
_checked = {}  # (Triton cache folder, device index) -> persist names the shipped bundle covers (empty: none)


def ensure_shipped(device) -> set:
    """Install the shipped bundle made for ``device`` (once per process and cache folder; a marker file in the
    cache folder makes later processes skip it). Returns the persist names of the launches it covers."""
    if not settings.shipped_kernels() or settings.interpreting():
        return set()
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        return set()
    root = _cache_root()
    slot = (root, dev.index if dev.index is not None else torch.cuda.current_device())
    found = _checked.get(slot)
    if found is not None:
        return found
    with _lock:
        found = _checked.get(slot)
        if found is not None:
            return found
        found = set()
        shipped = os.listdir(SHIPPED_DIR) if os.path.isdir(SHIPPED_DIR) else []
        path = None
        if any(n.endswith(".tar.xz") for n in shipped):
            machine = bundle_key(dev)
            path = os.path.join(SHIPPED_DIR, bundle_name(machine))
        if path is not None and os.path.exists(path):
            try:
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()[:16]
                gpu = gpu_model(dev)
                model = hashlib.sha256(gpu.encode()).hexdigest()[:8]
                marker = os.path.join(root, f".dflash_kernels-shipped-{digest}-{model}.json")
                if os.path.exists(marker):
                    with open(marker) as f:
                        found = set(json.load(f)["signatures"])
                else:
                    report = install(path, machine=machine)
                    if report["skipped"] is None:
                        found = set(model_signatures(report["manifest"], gpu))
                        os.makedirs(root, exist_ok=True)
                        _write(marker, json.dumps({"bundle": path, "signatures": sorted(found)}).encode())
                    if settings.verbose():
                        print(f"[dflash_kernels] shipped kernels {os.path.basename(path)}: {report['installed']} "
                              f"entries copied into {root}, {report['present']} there already")
            except (OSError, tarfile.TarError, ValueError, KeyError) as e:
                import warnings

                warnings.warn(f"the shipped kernel bundle {path} could not be installed into {root} ({e}); its "
                              f"kernels compile at their first call", RuntimeWarning, stacklevel=2)
        _checked[slot] = found
        return found


def installed_signatures(device) -> set:
    """The persist names of launches whose compiled kernels the shipped bundle put into the cache folder."""
    return ensure_shipped(device)
