"""The README's Python examples, run as a user would paste them.

Every ```python block of ``README.md`` has a runner here (a block without one fails
:func:`test_every_readme_example_has_a_runner`). A runner executes the block's text in a fresh
namespace inside a temporary working directory. Where a block names a file the user has (a
checkpoint of their run, their photos, an official release), the runner makes that file and, for
a path under a run directory, substitutes the path of a tiny checkpoint; each substitution is
listed in the runner and must match the README's text, so a changed example fails here rather than
going stale. Values the README shows in a comment (``expr  # value``, or ``expr`` then a
``# value`` line) are checked against what the expression gives.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from hub_cache import hub_cache  # noqa: F401  (fixture)
from test_predict import det_ckpt, photos  # noqa: F401  (fixtures)
from test_swin import randomize_

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    """The text of every ```python block of the README, in order."""
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def block(first_line: str) -> str:
    """The one README block whose first line starts with ``first_line``."""
    found = [b for b in python_blocks() if b.startswith(first_line)]
    assert len(found) == 1, f"README: expected one ```python block starting {first_line!r}, found {len(found)}"
    return found[0]


def substituted(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in text, f"README example no longer contains {old!r}: update tests/test_readme.py"
        text = text.replace(old, new)
    return text


def _literal(comment: str) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(comment.strip())
    except (ValueError, SyntaxError):
        return False, None


def _matches(shown: Any, actual: Any) -> bool:
    """``actual == shown``, where ``...`` in a shown list stands for any run of items."""
    if isinstance(shown, list) and Ellipsis in shown:
        if not isinstance(actual, list):
            return False
        pattern = "".join(".*?" if s is Ellipsis else re.escape(repr(s)) + "," for s in shown)
        return re.fullmatch(pattern, "".join(repr(a) + "," for a in actual), flags=re.S) is not None
    return actual == shown


def shown_values(text: str) -> list[tuple[str, Any]]:
    """``(expression, value)`` for each expression statement whose value the README shows as a literal
    comment, on its own line or on the next line."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        code, _, comment = line.partition("#")
        code = code.strip()
        if not code or "=" in code.replace("==", ""):
            continue
        try:
            ast.parse(code, mode="eval")
        except SyntaxError:
            continue
        ok, value = _literal(comment) if comment else (False, None)
        if not ok and i + 1 < len(lines) and lines[i + 1].lstrip().startswith("#"):
            ok, value = _literal(lines[i + 1].lstrip()[1:])
        if ok:
            found.append((code, value))
    return found


def run(text: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute ``text`` and check every value it shows; returns the namespace."""
    ns: dict[str, Any] = {"__name__": "__readme__"} if namespace is None else namespace
    exec(compile(text, str(README), "exec"), ns)  # noqa: S102  (the project's own README)
    for expr, value in shown_values(text):
        actual = eval(expr, ns)  # noqa: S307
        assert _matches(value, actual), f"README shows {expr} -> {value!r}, it gives {actual!r}"
    return ns


def _official_swinv2_tiny(path: Path) -> None:
    """A random ``swinv2_tiny_patch4_window8_256.pth`` in the official release's layout."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    timm_model = randomize_(SwinTransformerV2(img_size=256, window_size=8, embed_dim=96, depths=(2, 2, 6, 2),
                                              num_heads=(3, 6, 12, 24)), seed=3)
    # the official files keep each stage's patch merging at the start of the next stage's list
    sd = {re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k): v
          for k, v in timm_model.state_dict().items()}
    torch.save({"model": sd}, path)


# ------------------------------------------------------------------------------------ runners

def run_backbones(tmp_path: Path, **_: Any) -> None:
    ns = run(block("import torch, vtdense\n"))
    assert ns["backbone"].window_size == (16, 16)


def run_checkpoints(tmp_path: Path, hub_cache: Callable[..., Path], **_: Any) -> None:  # noqa: F811
    from timm.models.swin_transformer import SwinTransformer

    timm_swin = randomize_(SwinTransformer(img_size=224, window_size=7), seed=1)
    hub_cache("timm/swin_tiny_patch4_window7_224.ms_in1k",
              {"model.safetensors": timm_swin.state_dict(), "config.json": {"architecture": "swin_tiny_patch4_window7_224"}})
    _official_swinv2_tiny(tmp_path / "swinv2_tiny_patch4_window8_256.pth")
    import vtdense

    ns = run("import vtdense\n" + block("backbone = vtdense.create_backbone(\"swin_tiny\", pretrained="))
    assert (tmp_path / "my_backbone.safetensors").is_file()
    assert ns["backbone"].window_size == (12, 12)
    # the V2 release went into the V2 backbone, and the saved V1 weights came back with every block's
    # bias table resized to window 12
    assert ns["report"].format == "official" and all(k.startswith("out_norms.") for k in ns["report"].missing)
    resized = ns["backbone"].load_report.resized
    assert len(resized) == 12 and all(new == (23 * 23, old[1]) for _, old, new, _ in resized)
    reloaded = vtdense.create_backbone("swin_tiny", pretrained="timm/swin_tiny_patch4_window7_224.ms_in1k")
    assert torch.equal(ns["backbone"].patch_embed.proj.weight, reloaded.patch_embed.proj.weight)
    assert torch.equal(ns["same"].patch_embed.proj.weight, reloaded.patch_embed.proj.weight)  # pretrained=True


def run_detection(tmp_path: Path, **_: Any) -> None:
    ns = run(block("from vtdense.models.detection import build_detector\n"))
    assert ns["model"].roi_heads.box_predictor.cls_score.out_features == 81


def run_segmentation(tmp_path: Path, **_: Any) -> None:
    _official_swinv2_tiny(tmp_path / "swinv2_tiny_window8.pth")
    ns = run(block("import vtdense, segmentation_models_pytorch as smp\n"))
    assert ns["model"].encoder.backbone.window_size == (16, 16)


def run_predict(tmp_path: Path, det_ckpt: Path, photos: Path, capsys: pytest.CaptureFixture, **_: Any) -> None:  # noqa: F811
    text = substituted(block("from vtdense.tasks.detection import DetectionTask\n"), {
        '"runs/coco_swin_demo/lightning_logs/version_0/checkpoints/best-epoch001.ckpt"': repr(str(det_ckpt)),
        '"my_photos/"': repr(str(photos) + "/"),
        "score_thresh=0.5": "score_thresh=0.0",  # an untrained model's scores
    })
    run(text)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(list(photos.iterdir())) and all(line.startswith(str(photos)) for line in printed)


def run_export(tmp_path: Path, det_ckpt: Path, **_: Any) -> None:  # noqa: F811
    import vtdense

    text = substituted(block("import vtdense\nvtdense.export("), {
        '"runs/coco_swin/lightning_logs/version_0/checkpoints/last.ckpt"': repr(str(det_ckpt)),
        "input_size=(800, 1216)": "input_size=(96, 128)",
        "input_size=(512, 512)": "input_size=(64, 64)",
    })
    tiny = vtdense.create_backbone("swin_tiny", embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=4)
    run(text, {"__name__": "__readme__", "backbone": tiny, "ckpt_path": det_ckpt})
    assert all((tmp_path / f).stat().st_size > 0 for f in ("detector.onnx", "backbone.onnx", "fpn.onnx"))


def run_curves(tmp_path: Path, **_: Any) -> None:
    from vtdense.callbacks import TrainingCurves

    ns = run(block("import lightning as L\n"))
    assert any(isinstance(c, TrainingCurves) for c in ns["trainer"].callbacks)


RUNNERS: dict[str, Callable[..., None]] = {
    "import torch, vtdense\n": run_backbones,
    'backbone = vtdense.create_backbone("swin_tiny", pretrained=': run_checkpoints,
    "from vtdense.models.detection import build_detector\n": run_detection,
    "import vtdense, segmentation_models_pytorch as smp\n": run_segmentation,
    "from vtdense.tasks.detection import DetectionTask\n": run_predict,
    "import vtdense\nvtdense.export(": run_export,
    "import lightning as L\n": run_curves,
}


def test_every_readme_example_has_a_runner() -> None:
    blocks = python_blocks()
    assert blocks, "no ```python block found in README.md"
    for text in blocks:
        owners = [start for start in RUNNERS if text.startswith(start)]
        assert len(owners) == 1, f"README example without exactly one runner in tests/test_readme.py:\n{text}"


@pytest.mark.parametrize("start", list(RUNNERS), ids=[f.__name__.removeprefix("run_") for f in RUNNERS.values()])
def test_readme_example_runs(start: str, request: pytest.FixtureRequest, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    runner = RUNNERS[start]
    extra = {name: request.getfixturevalue(name) for name in ("hub_cache", "det_ckpt", "photos")
             if name in runner.__code__.co_varnames[:runner.__code__.co_argcount]}
    runner(tmp_path=tmp_path, capsys=capsys, **extra)


def test_shown_values_are_checked() -> None:
    """The comment check itself: a wrong value shown would fail."""
    text = "x = [1, 2, 3]\nx  # [1, 2, 3]\nlen(x)\n# 3\n"
    assert shown_values(text) == [("x", [1, 2, 3]), ("len(x)", 3)]
    run(text)
    with pytest.raises(AssertionError, match="README shows len"):
        run("x = [1, 2]\nlen(x)  # 3\n")
    assert _matches(["b", ..., "d"], ["b", "c", "d"]) and _matches(["a", ..., "c", ...], ["a", "b", "c", "d"])
    assert not _matches(["b", ..., "d"], ["a", "b", "d"]) and not _matches([..., "x"], ["a", "b"])
