"""An offline install: launch/wheelhouse.py collects what a target lacks, and jdp installs
from that folder alone (`pip install --no-index`) into a fresh environment.

The target is made like a GPU host's image: a new venv that sees this venv's heavy
stack (jax, flax, TFDS, ...) but lacks ml-collections and tensorboardX, so only those
and jdp must come from the wheelhouse. The registry is used to build the wheelhouse,
never by the install. The GPU hosts' own image is checked against its package list.
"""

import os
import subprocess
import sys
import sysconfig
import venv

import pytest
from packaging.utils import canonicalize_name

from runs import REPO, load_launch_script

pytestmark = pytest.mark.slow

LACKING = ("ml_collections", "tensorboardx")  # dropped from the target's view
OFFLINE = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}  # no index, no find-links


def _target_view(view_dir) -> None:
    """This venv's packages as a site directory, less LACKING and jdp itself."""
    site = sysconfig.get_paths()["purelib"]
    view_dir.mkdir()
    for name in os.listdir(site):
        lowered = name.lower()
        if lowered.startswith((*LACKING, "jdp", "__editable__")):
            continue
        os.symlink(os.path.join(site, name), view_dir / name)


def _run(argv, env=None, cwd=None):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    proc = subprocess.run(argv, capture_output=True, text=True, env={**environ, **(env or {})},
                          cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_jdp_installs_offline_from_a_wheelhouse_of_only_what_the_target_lacks(tmp_path):
    view = tmp_path / "view"
    _target_view(view)
    have = tmp_path / "have.txt"
    have.write_text(_run([sys.executable, "-m", "pip", "list", "--format=freeze",
                          "--path", str(view)]))
    wheels = tmp_path / "wheels"
    _run([sys.executable, os.path.join(REPO, "launch", "wheelhouse.py"), f"--have={have}",
          f"--out={wheels}"])
    names = sorted(name.split("-")[0].lower() for name in os.listdir(wheels)
                   if name.endswith(".whl"))
    assert names == ["jdp", "ml_collections", "tensorboardx"]

    target = tmp_path / "target"
    venv.create(target, with_pip=True)
    python = str(target / "bin" / "python")
    target_site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                        "['purelib'])"]).strip()
    with open(os.path.join(target_site, "target_image.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({str(view)!r})\n")
    _run([python, "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "jdp"],
         env=OFFLINE)
    # Something tiny, from outside the checkout: the installed jdp, its config and writers.
    out = _run([python, "-c", (
        "import jax, jdp, jdp.main, ml_collections, tensorboardX\n"
        "from jdp.config import defaults, validate\n"
        "print(validate(defaults(), 1, 1).per_device_batch_size, "
        "int(jax.jit(lambda x: x.sum())(jax.numpy.arange(4))), jdp.__file__, "
        "ml_collections.__file__)")], env={"JAX_PLATFORMS": "cpu"}, cwd=tmp_path)
    batch, total, jdp_file, collections_file = out.split()
    assert (batch, total) == ("128", "6")
    assert jdp_file.startswith(target_site) and collections_file.startswith(target_site)


def test_the_gpu_image_keeps_its_jax(tmp_path):
    """The GPU hosts' image (launch/h200_image_packages.txt: Python 3.12 with jax, jaxlib
    and the CUDA 13 plugin at 0.11.2): the wheelhouse of `jdp[cuda13]` for it, resolved
    by pip for Python 3.12, holds none of jax's packages, so installing from it keeps the
    image's jax, and it holds jdp and what the image lacks."""
    image_list = os.path.join(REPO, "launch", "h200_image_packages.txt")
    image = load_launch_script("wheelhouse").read_have(image_list)
    jax_stack = {name for name in image
                 if name in ("jax", "jaxlib") or name.startswith(("jax-cuda", "nvidia-"))}
    assert image["jax"] == image["jaxlib"] == image["jax-cuda13-plugin"] == "0.11.2"
    wheels = tmp_path / "wheels"
    out = _run([sys.executable, os.path.join(REPO, "launch", "wheelhouse.py"),
                "--target_python=3.12", "--extras=cuda13", f"--have={image_list}",
                f"--out={wheels}"])
    names = {canonicalize_name(name.split("-")[0]) for name in os.listdir(wheels)
             if name.endswith(".whl")}
    assert "jdp" in names and "ml-collections" in names, names
    assert not names & jax_stack, (names & jax_stack, out)
    added = (wheels / "requirements.txt").read_text().split()
    assert not [line for line in added if canonicalize_name(line.split("==")[0]) in jax_stack]
    assert not [line for line in out.splitlines()
                if line.startswith("note:") and line.split()[1] in jax_stack], out
