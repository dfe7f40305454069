"""A TorchScript model with an INT64 input, for the V2 clients' INT64 path:
ids INT64 [-1, 3] -> doubled INT64 [-1, 3] (ids * 2), total FP64 [-1] (row sums)."""

from __future__ import annotations

from pathlib import Path

PROPERTIES = """\
option.input_names=ids
option.input_dtypes=INT64
option.input_shapes=-1,3
option.output_names=doubled,total
option.output_dtypes=INT64,FP64
option.output_shapes=-1,3;-1
"""


def build_int_torchscript_dir(out_dir: str | Path) -> Path:
    import torch

    class Doubler(torch.nn.Module):
        def forward(self, ids: torch.Tensor):
            return ids * 2, ids.sum(dim=1).to(torch.float64)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.jit.script(Doubler()).save(str(out / "doubler.pt"))
    (out / "serving.properties").write_text(PROPERTIES)
    return out
