"""Moving a loaded model to its device. Weights load memory-mapped on the host; `place` moves every tensor
the model holds to the device, except the Engram tables above `HOST_TABLE_BYTES`, which stay memory-mapped
in host memory (~100 GB each in the released model): a step gathers only the rows it needs."""

import dataclasses

import torch

HOST_TABLE_BYTES = 1 << 30


def place(obj, device: torch.device, seen=None, kept: list | None = None):
    """Move the tensors reachable from `obj` (attributes, lists, tuples, dicts, dataclasses) to `device`,
    in place where they are held; a tensor held in several places is moved once. Returns obj. Every table
    left in host memory is appended to `kept` as (a name for it, bytes)."""
    seen = {} if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) not in seen:
            seen[id(obj)] = (obj, obj.to(device))  # keep obj alive so its id stays unique
        return seen[id(obj)][1]
    if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool, torch.device, torch.dtype)):
        return obj
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
    keep_on_host = getattr(obj, "HOST_TENSORS", ())
    for name, value in list(attrs.items()):
        if name in keep_on_host and isinstance(value, torch.Tensor) and \
                value.numel() * value.element_size() > HOST_TABLE_BYTES:
            if kept is not None:
                layer = getattr(obj, "layer", None)
                label = f"{type(obj).__name__}.{name}" + (f" of layer {layer}" if isinstance(layer, int) else "")
                kept.append((label, value.numel() * value.element_size()))
            continue
        if isinstance(value, (torch.Tensor, list, tuple, dict)) or dataclasses.is_dataclass(value) or \
                hasattr(value, "__dict__"):
            if name in ("rt", "cfg", "gen", "lm"):  # back references, not owned
                continue
            setattr(obj, name, place(value, device, seen, kept))
    return obj
