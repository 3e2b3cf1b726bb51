"""Which diffusers / lycoris-lora releases work on which torch: the measurement behind install.py's TORCH_CAPS.

``python tests/a1111_venv/releases.py DIR TORCH_VERSION REQUIREMENT...`` makes (or reuses) a venv at DIR with
torch==TORCH_VERSION from the package index (a few GB), then for each requirement (``diffusers==0.36.0``,
``lycoris-lora==4.1.0``) installs it beside that torch and runs what SD Slim uses of it: a diffusers
``UNet2DConditionModel`` forward and backward, or lycoris' LoCon/LoHa/LoKr weight functions with
``backend="torch"``. Prints one line per requirement: ``works`` or the last line of the error."""
import subprocess
import sys
import venv
from pathlib import Path

CHECKS = {
    "diffusers": """
import torch
from diffusers import UNet2DConditionModel
u = UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                         down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=8,
                         up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32)
out = u(torch.randn(1, 4, 8, 8), 10, torch.randn(1, 3, 32)).sample
out.square().mean().backward()
assert out.shape == (1, 4, 8, 8)
""",
    "lycoris-lora": """
import torch
from lycoris.functional import locon, loha, lokr
d, u, m = torch.randn(2, 3, 1, 1), torch.randn(5, 2, 1, 1), torch.randn(2, 2, 3, 3)
assert locon.diff_weight(d, u, m, gamma=0.5, backend="torch").numel() == 5 * 3 * 9
loha.diff_weight(torch.randn(2, 3), torch.randn(4, 2), torch.randn(2, 3), torch.randn(4, 2), None, None, gamma=1.0,
                 backend="torch")
lokr.kron_weight(torch.randn(2, 2), None, None, None, torch.randn(3, 2), torch.randn(2, 3), None, scale=1.0,
                 backend="torch")
"""}


def _pip(python, *args):
    return subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True)


def torch_venv(root, torch_version):
    """The python of a venv at ``root`` holding torch==``torch_version`` (made unless it is there)."""
    python = Path(root) / "bin" / "python"
    if not python.exists():
        venv.create(root, with_pip=True)
        done = _pip(python, "install", "--quiet", f"torch=={torch_version}")
        if done.returncode:
            raise RuntimeError(f"torch=={torch_version}: {done.stderr.strip()}")
    return python


def works(python, requirement):
    """``requirement`` installed beside the venv's torch (never changing it), then SD Slim's use of it: "works", or
    why not (its last line)."""
    torch_version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                                   capture_output=True, text=True, check=True).stdout.strip().split("+")[0]
    pin = Path(python).parent.parent / "torch-pin.txt"
    pin.write_text(f"torch=={torch_version}\n")
    done = _pip(python, "install", "--quiet", requirement, "-c", pin)
    if done.returncode:
        return f"pip failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    name = requirement.split("=")[0].split("<")[0].split(">")[0].strip().lower().replace("_", "-")
    run = subprocess.run([str(python), "-W", "ignore", "-c", CHECKS[name]], capture_output=True, text=True)
    return "works" if run.returncode == 0 else (run.stderr.strip().splitlines() or ["?"])[-1][:300]


if __name__ == "__main__":
    root, torch_version, *requirements = sys.argv[1:]
    py = torch_venv(root, torch_version)
    for req in requirements:
        print(f"{req} on torch {torch_version}: {works(py, req)}", flush=True)
