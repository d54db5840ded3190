"""Running models up to the layers circuits read: one forward pass per model and batch, whatever the circuits.

A model is loaded by its kind: an mpiscale train results file (its layers are
the modules ``collect --layers`` names), or a user's module saved with
TorchScript (``torch.jit.save``) or ``torch.export`` (``torch.export.save``),
whose output is the activation its circuits project. For a train model,
``train.model.layer_outputs`` captures every wanted layer and stops the pass
once the deepest has run: the layers after it are never computed, and
circuits of several layers of one model share the pass (the common prefix is
computed once). The model runs on the job's device (``--device``); its
outputs come back to host memory, where the atoms and plan ops run.
"""

from __future__ import annotations

import zipfile

import numpy as np
import torch

from ..io import DataFileError
from ..train import layer_outputs, model_rows
from .store import ModelRef, file_sha256


class ModelRunner:
    """One model, the ``layers`` its circuits read (``""``: the module's own output)."""

    def __init__(self, model: ModelRef, layers: list[str], verify: bool = True, device: str = "cpu") -> None:
        if verify and file_sha256(model.path) != model.sha256:
            raise DataFileError(model.path, "has changed since its circuits were added to the catalogue (its "
                                            "SHA-256 differs): add them again from the new model")  # fmt: skip
        self.model, self.layers, self.device = model, layers, device
        self.module = load_module(model, device)
        if model.kind == "train":
            known = {name for name, _ in self.module.named_modules() if name}
            missing = [layer for layer in layers if layer not in known]
            if missing:
                raise DataFileError(model.path, f"has no module {', '.join(missing)} (the catalogue names it)")

    def __call__(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Each layer's output for ``rows`` (float32, one row per input), in host memory. A train model takes
        float64 rows as they are, as in training and collect (it standardises them before any rounding); a
        user's module takes the type it was added with."""
        wanted = np.dtype(self.model.input_dtype)
        if self.model.kind == "train":
            inputs = torch.from_numpy(np.ascontiguousarray(model_rows(np.asarray(rows), wanted))).to(self.device)
            return layer_outputs(self.module, self.layers, inputs)
        inputs = torch.from_numpy(np.ascontiguousarray(rows, wanted)).to(self.device)
        with torch.no_grad():
            output = self.module(inputs)
        return {"": output.reshape(len(rows), -1).cpu().numpy().astype(np.float32, copy=False)}


def load_module(model: ModelRef, device: str = "cpu") -> torch.nn.Module:
    """The model of ``model``'s file on ``device``, ready for inference.

    A ``torch.export`` program has the device of its example inputs baked into its factory ops
    (``aten.ones(..., device=cpu)``): moving the module's parameters leaves those behind, so the program itself is
    moved (``move_to_device_pass``) before its module is made. TorchScript loads straight onto ``device``.
    """
    if model.kind == "train":
        from ..train import load_trained

        return load_trained(model.path)[0].to(device)
    try:
        if model.kind == "export":
            from torch.export.passes import move_to_device_pass

            return move_to_device_pass(torch.export.load(model.path), device).module()
        module = torch.jit.load(model.path, map_location=device)
    except Exception as error:  # torch's loaders raise many kinds for a file that is not theirs
        raise DataFileError(model.path, f"cannot be loaded as a {model.kind} module: {one_line(error)}") from None
    module.eval()
    return module


def detect_module(path: str) -> str:
    """``export`` or ``torchscript``: the kind of saved module ``path`` holds, told from the archive's own entries
    (both are zip archives), so only the right loader ever runs (a DataFileError for neither)."""
    neither = "is neither a torch.export program (torch.export.save) nor a TorchScript module (torch.jit.save)"
    try:
        with zipfile.ZipFile(path) as archive:
            entries = {name.split("/", 1)[-1] for name in archive.namelist()}
    except (OSError, zipfile.BadZipFile) as error:
        raise DataFileError(path, f"{neither}: {one_line(error)}") from None
    if entries & {"archive_format", "serialized_exported_program.json"}:
        return "export"
    if "constants.pkl" in entries or any(entry.startswith("code/") for entry in entries):
        return "torchscript"
    raise DataFileError(path, f"{neither}: a zip archive of neither's layout")


def one_line(error: BaseException) -> str:
    """An error's message on one line: the last line of a multi-line one (TorchScript puts its interpreter's
    traceback first and the error itself last)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
