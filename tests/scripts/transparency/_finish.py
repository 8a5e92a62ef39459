"""Shared by the transparency zoo: print a digest of the final weights and write
their bytes where FPAUDIT_TRANSPARENCY_OUT says (compared with and without fpaudit)."""

import hashlib
import os

import torch


def finish(**modules: torch.nn.Module) -> None:
    blob = bytearray()
    for owner, module in sorted(modules.items()):
        for name, tensor in module.state_dict().items():
            blob += f"{owner}.{name}:{tensor.dtype}:{tuple(tensor.shape)}\n".encode()
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            blob += flat.view(torch.uint8).numpy().tobytes()
    print(f"final weights sha256 {hashlib.sha256(blob).hexdigest()[:16]}")
    path = os.environ.get("FPAUDIT_TRANSPARENCY_OUT")
    if path:
        with open(path, "wb") as file:
            file.write(blob)


def saves() -> str:
    """Where a script saves its checkpoints: FPAUDIT_TRANSPARENCY_SAVES (compared file
    by file with and without fpaudit), else a fresh temporary folder."""
    import tempfile

    folder = os.environ.get("FPAUDIT_TRANSPARENCY_SAVES") or tempfile.mkdtemp()
    os.makedirs(folder, exist_ok=True)
    return folder
