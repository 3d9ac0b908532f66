"""Moving a loaded model to its device. Weights load memory-mapped on the host; `place` moves every tensor
the model holds to the device, except the Engram tables above `HOST_TABLE_BYTES`, which stay memory-mapped
in host memory (~100 GB each in the released model): a step gathers only the rows it needs, and on the fast
path the lookup kernel reads them in place once `map_to_device` has registered the table with the GPU."""

import dataclasses

import torch

HOST_TABLE_BYTES = 1 << 30
LEAVES = (str, int, float, bool, torch.device, torch.dtype, type(None))  # nothing inside to move


def place(obj, device: torch.device, seen=None, kept: list | None = None):
    """Move the tensors reachable from `obj` (attributes, lists, tuples, dicts, dataclasses) to `device`,
    in place where they are held; a tensor held in several places is moved once. Returns obj. Every table
    left in host memory is appended to `kept` as (a name for it, the tensor)."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen[id(obj)] = (obj, obj.to(device))  # keep obj alive so its id stays unique
        return seen[id(obj)][1]
    if isinstance(obj, LEAVES) or id(obj) in seen or isinstance(obj, tuple) and all(isinstance(v, LEAVES) for v in obj):
        return obj  # a shape: nothing to move, no tuple to make
    seen[id(obj)] = (obj, obj)
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            obj[i] = place(v, device, seen, kept)
        return obj
    if isinstance(obj, tuple):
        return type(obj)(place(v, device, seen, kept) for v in obj) if not hasattr(obj, "_fields") else obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = place(v, device, seen, kept)
        return obj
    attrs = vars(obj) if hasattr(obj, "__dict__") else {}
    for name, value in list(attrs.items()):
        if stays_on_host(obj, name, value):
            if kept is not None:
                layer = getattr(obj, "layer", None)
                label = f"{type(obj).__name__}.{name}" + (f" of layer {layer}" if isinstance(layer, int) else "")
                kept.append((label, value))
            continue
        owned = name not in ("rt", "cfg", "gen", "lm")  # else a back reference
        if owned and (isinstance(value, (torch.Tensor, list, tuple, dict)) or dataclasses.is_dataclass(value)
                      or hasattr(value, "__dict__")):
            setattr(obj, name, place(value, device, seen, kept))
    return obj


def stays_on_host(owner, name: str, value) -> bool:
    """Whether `place` leaves `owner`'s attribute `name` (holding `value`) in host memory: a table the
    owner lists in HOST_TENSORS (Engram's), larger than HOST_TABLE_BYTES."""
    return name in getattr(owner, "HOST_TENSORS", ()) and isinstance(value, torch.Tensor) and \
        value.numel() * value.element_size() > HOST_TABLE_BYTES


def map_to_device(t: torch.Tensor) -> None:
    """Let kernels on the current GPU read host tensor `t` in place: its pages are locked and mapped into
    the device's address space (cudaHostRegister, read-only: the checkpoint's pages are mapped read-only).
    Locking faults every page in once, so a 100 GB table costs its disk read at load, not at the first
    token. With unified addressing the device reads through the host pointer itself."""
    mapped, read_only = 0x02, 0x08  # cudaHostRegisterMapped | cudaHostRegisterReadOnly
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, mapped | read_only)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of a {nbytes / 1e9:.1f} GB host table failed with CUDA error "
                           f"{int(err)}: the fast path cannot read it in place")
