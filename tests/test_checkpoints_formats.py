"""Checkpoint containers and layouts: detectron2 pickles (and refusing unsafe ones), safetensors
save/load with the config in the metadata, format detection and the load report."""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torchvision

import vtdense
from vtdense import CheckpointError
from vtdense.checkpoints.convert import detect_format

from hub_cache import hub_cache  # noqa: F401  (fixture)
from test_mvitv2 import to_flat
from test_swin import randomize_

SWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4)
MVIT = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=1)


def _write_d2_pickle(path: Path, sd: dict[str, torch.Tensor]) -> None:
    """detectron2 model-zoo layout: numpy arrays under ``model``, plus ``__author__``."""
    blob = {"model": {k: v.numpy() for k, v in sd.items()}, "__author__": "Detectron2 Model Zoo", "matching_heuristics": True}
    with path.open("wb") as f:
        pickle.dump(blob, f, protocol=2)


def _swin_to_d2(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k)  # merging ends a stage
        k = re.sub(r"^out_norms\.stage(\d)\.", lambda m: f"norm{int(m[1]) - 1}.", k)
        out["backbone.bottom_up." + k] = v
    out["backbone.fpn_lateral2.weight"] = torch.zeros(4, 4)  # neck and heads are not the backbone's
    out["roi_heads.box_predictor.cls_score.weight"] = torch.zeros(3, 4)
    return out


def _same(a: torch.nn.Module, b: torch.nn.Module, size=(1, 3, 64, 96)) -> None:
    x = torch.randn(*size)
    with torch.no_grad():
        for (k, fa), fb in zip(a.eval()(x).items(), b.eval()(x).values()):
            assert torch.equal(fa, fb), k


def test_detectron2_pickles_load_for_swin_and_mvitv2(tmp_path: Path, hub_cache) -> None:  # noqa: F811
    src = randomize_(vtdense.create_backbone("swin_tiny", **SWIN), seed=1)
    _write_d2_pickle(tmp_path / "swin.pkl", _swin_to_d2(src.state_dict()))
    dst = vtdense.create_backbone("swin_tiny", **SWIN)
    report = vtdense.load_pretrained(dst, tmp_path / "swin.pkl")
    assert report == ([], []) and report.container == "detectron2-pkl" and report.format == "detectron2"
    assert {k for k, _ in report.dropped} == {"backbone.fpn_lateral2.weight", "roi_heads.box_predictor.cls_score.weight"}
    assert ("backbone.bottom_up.layers.0.downsample.reduction.weight", "layers.1.downsample.reduction.weight") in report.loaded
    _same(src, dst)

    src = randomize_(vtdense.create_backbone("mvitv2_tiny", **MVIT), seed=2)
    sd = src.state_dict()
    flat = to_flat({k: v for k, v in sd.items() if not k.startswith("out_norms.")}, src.depths, True)
    d2 = {f"backbone.bottom_up.{k}": v for k, v in flat.items()}
    d2.update({f"backbone.bottom_up.scale{i + 2}_norm.{p}": sd[f"out_norms.stage{i + 1}.{p}"] for i in range(4) for p in ("weight", "bias")})
    _write_d2_pickle(tmp_path / "model_final.pkl", d2)
    dst = vtdense.create_backbone("mvitv2_tiny", **MVIT)
    report = vtdense.load_pretrained(dst, str(tmp_path / "model_final.pkl"))
    assert report == ([], []) and report.format == "detectron2"
    _same(src, dst)
    # a Hub repo holding only the model-zoo pickle: model_final.pkl is among the files tried
    hub_cache("me/d2_mvit", {"model_final.pkl": (tmp_path / "model_final.pkl").read_bytes()})
    again = vtdense.create_backbone("mvitv2_tiny", pretrained="me/d2_mvit", **MVIT)
    assert again.load_report.container == "detectron2-pkl"
    _same(src, again)


class _Payload:
    """Pickles as a call to os.system: what an attacker would hide in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["evil.pkl", "evil.pth"])
def test_pickle_with_a_payload_is_refused_naming_the_file(tmp_path: Path, name: str) -> None:
    marker = tmp_path / "PWNED"
    blob = {"model": {"w": np.zeros(3, dtype=np.float32), "x": _Payload(marker)}, "__author__": "x"}
    path = tmp_path / name
    path.write_bytes(pickle.dumps(blob, protocol=2))
    with pytest.raises(CheckpointError, match=re.escape(str(path))) as err:
        vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **SWIN), path)
    if name.endswith(".pkl"):
        assert re.search(r"refused to unpickle (posix|os|nt)\.system", str(err.value))
    assert not marker.exists()
    pickle.loads(pickle.dumps(blob["model"]["w"]))  # sanity: the array part alone is fine


class _Call:
    """Pickles as the call ``fn(*args)`` (``__reduce__``): a global plus arguments, as an attacker writes it."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")  # torch.load, tried first, says so
@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("what", ["numpy.save", "builtins.eval", "builtins.exec", "builtins.getattr"])
def test_detectron2_unpickler_admits_nothing_but_arrays_and_containers(tmp_path: Path, what: str, protocol: int) -> None:
    """The allowlist is (module, name) pairs, not modules: ``numpy.save`` lives in the module that
    provides ``numpy.ndarray`` and writes a file when called, ``eval`` / ``exec`` run code,
    ``getattr`` reaches anything. Each is refused before it is called, naming the file and the
    global (protocol 2 spells builtins ``__builtin__``, as Python 2 era files do)."""
    from vtdense.checkpoints.io import read_checkpoint

    marker = tmp_path / "PWNED.npy"
    payload = {
        "numpy.save": _Call(np.save, str(marker), np.zeros(1)),
        "builtins.eval": _Call(eval, f"open({str(marker)!r}, 'w').close()"),
        "builtins.exec": _Call(exec, f"open({str(marker)!r}, 'w').close()"),
        "builtins.getattr": _Call(getattr, np.zeros(1), "tofile"),
    }[what]
    path = tmp_path / "model_final.pkl"
    data = pickle.dumps({"model": {"w": np.ones(3, np.float32), "x": payload}, "__author__": "x"}, protocol=protocol)
    path.write_bytes(data)
    module, name = what.split(".")
    spelled = "(__builtin__|builtins)" if module == "builtins" else module
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: refused to unpickle {spelled}\.{name}"):
        read_checkpoint(path)
    assert not marker.exists()
    if what != "builtins.getattr":  # sanity: the payload is live, a plain unpickler runs it
        pickle.loads(data)
        assert marker.exists()


def test_malformed_detectron2_pickles_are_one_error_naming_the_file(tmp_path: Path) -> None:
    """Persistent ids (torch's storage references, which the restricted reader must never resolve),
    a pickle that is not a dict and a ``model`` that is not a dict: each a :class:`CheckpointError`
    naming the file, not a ``pickle`` / ``AttributeError`` from deep inside."""
    from vtdense.checkpoints.io import read_checkpoint

    class _Ref:
        pass

    class _PersistentPickler(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage-0" if isinstance(obj, _Ref) else None

    buf = io.BytesIO()
    _PersistentPickler(buf, protocol=2).dump({"model": {"w": _Ref()}, "__author__": "x"})
    cases = {
        "persistent.pkl": (buf.getvalue(), "persistent ids are not allowed"),
        "list.pkl": (pickle.dumps([np.zeros(2)], protocol=2), "a detectron2 pickle is a dict, got list"),
        "model.pkl": (pickle.dumps({"model": [np.zeros(2)]}, protocol=2), "'model' is not a dict of arrays"),
    }
    for name, (blob, message) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(CheckpointError, match=rf"{re.escape(str(tmp_path / name))}: {re.escape(message)}"):
            read_checkpoint(tmp_path / name)


class _Py2Pickler(pickle._Pickler):
    """Writes ``bytes`` and ``str`` as Python 2 ``str`` opcodes (``SHORT_BINSTRING`` /
    ``BINSTRING``) and numpy's globals as ``numpy.core.multiarray``: the bytes of a detectron2
    model-zoo ``.pkl`` written by Python 2."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj) -> None:
        raw = obj.encode("latin1") if isinstance(obj, str) else obj
        n = len(raw)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + n.to_bytes(4, "little")) + raw)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str
    dispatch[str] = _save_py2_str


def test_python2_detectron2_pickle_loads(tmp_path: Path) -> None:
    """Array data in a Python 2 pickle is a ``str`` of raw bytes (not valid ASCII): read as
    latin-1, as numpy documents for such files, it gives the arrays back bit for bit."""
    import pickletools

    from vtdense.checkpoints.io import read_checkpoint

    src = randomize_(vtdense.create_backbone("swin_tiny", **SWIN), seed=5)
    blob = {"model": {k: v.numpy() for k, v in _swin_to_d2(src.state_dict()).items()}, "__author__": "Detectron2 Model Zoo"}
    blob["model"]["backbone.bottom_up.step"] = np.int64(90000)  # a numpy scalar (admitted by the reader): not a weight, skipped
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(blob)
    data = buf.getvalue().replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
    assert {op.name for op, *_ in pickletools.genops(data)} >= {"SHORT_BINSTRING", "BINSTRING"}
    assert b"_codecs" not in data and b"numpy.core.multiarray\n_reconstruct" in data
    path = tmp_path / "model_final_py2.pkl"
    path.write_bytes(data)
    file = read_checkpoint(path)
    assert file.container == "detectron2-pkl"
    assert set(file.obj["model"]) == set(_swin_to_d2(src.state_dict()))
    for k, v in _swin_to_d2(src.state_dict()).items():
        assert torch.equal(file.obj["model"][k], v), k
    dst = vtdense.create_backbone("swin_tiny", **SWIN)
    assert vtdense.load_pretrained(dst, path) == ([], [])
    _same(src, dst)


def test_a_sharded_checkpoint_folder_is_named_where_a_file_is_needed(tmp_path: Path) -> None:
    """FSDP with ``save_distributed_checkpoint=True`` writes ``last.ckpt`` as a folder of shards: loading
    a task, predicting or exporting from it is one error saying so (it resumes a fit; nothing else reads it)."""
    from vtdense.tasks.detection import DetectionTask
    from vtdense.tasks.segmentation import SegmentationTask

    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    (folder / "__0_0.distcp").write_bytes(b"")
    message = rf"checkpoint '{re.escape(str(folder))}' is the folder of a sharded checkpoint \(FSDP with save_distributed_checkpoint=True\)"
    for load in (DetectionTask.from_checkpoint, SegmentationTask.from_checkpoint, lambda f: vtdense.export(f, tmp_path / "x.onnx")):
        with pytest.raises(ValueError, match=message):
            load(folder)
    (folder / ".metadata").unlink()
    with pytest.raises(ValueError, match=rf"checkpoint '{re.escape(str(folder))}' is a folder, not a .ckpt file"):
        DetectionTask.from_checkpoint(folder)
    assert not (tmp_path / "x.onnx").exists()


def test_unreadable_containers_name_the_file(tmp_path: Path) -> None:
    """A truncated safetensors file, torch zip archive or detectron2 pickle, and a torch file holding
    something other than a state dict (a training checkpoint whose weights sit under a key vtdense does
    not know): one :class:`CheckpointError` naming the file and saying what is wrong."""
    from vtdense.checkpoints.io import cut_short

    model = vtdense.create_backbone("swin_tiny", **SWIN)
    path = vtdense.save_backbone(model, tmp_path / "cut.safetensors")
    whole = path.read_bytes()
    assert cut_short(path) is None
    path.write_bytes(whole[:-100])  # the data ends early: the header is intact
    assert cut_short(path) == (f"it is a safetensors file of {len(whole) - 100:,} bytes where its header describes "
                               f"{len(whole):,}: the file is cut short (an interrupted save, copy or download)")
    with pytest.raises(CheckpointError, match=rf"^cannot read checkpoint {re.escape(str(path))}: it is a safetensors file "
                                              r"of [\d,]+ bytes where its header describes [\d,]+: the file is cut short"):
        vtdense.load_pretrained(model, path)
    # a torch.save zip archive cut short anywhere loses its end record
    zipped = tmp_path / "cut.pth"
    torch.save(model.state_dict(), zipped)
    whole = zipped.read_bytes()
    assert cut_short(zipped) is None
    for cut in (whole[: len(whole) // 2], whole[:-1]):
        zipped.write_bytes(cut)
        with pytest.raises(CheckpointError, match=rf"^cannot read checkpoint {re.escape(str(zipped))}: it is a zip archive "
                                                  rf"\(torch.save's format\) of {len(cut):,} bytes without the end record "
                                                  r"that closes one: the file is cut short or damaged"):
            vtdense.load_pretrained(model, zipped)
    other = tmp_path / "train.pth"
    torch.save({"net": model.state_dict(), "epoch": 3}, other)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(other))}: not a state dict of tensors"):
        vtdense.load_pretrained(model, other)
    # a detectron2 pickle cut short (an interrupted download), at any length
    d2 = tmp_path / "model_final.pkl"
    _write_d2_pickle(d2, {f"backbone.bottom_up.{k}": v for k, v in model.state_dict().items()})
    whole = d2.read_bytes()
    for cut in (whole[: len(whole) // 2], whole[:-1]):
        d2.write_bytes(cut)
        with pytest.raises(CheckpointError, match=rf"cannot read detectron2 pickle {re.escape(str(d2))}: (UnpicklingError|EOFError)"):
            vtdense.load_pretrained(model, d2)


def test_save_backbone_writes_safetensors_with_config_and_old_files_still_load(tmp_path: Path) -> None:
    from safetensors import safe_open

    model = randomize_(vtdense.create_backbone("swinv2_tiny", **SWIN), seed=3)
    path = vtdense.save_backbone(model, tmp_path / "bb.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == set(model.state_dict())
    assert json.loads(meta["vtdense_backbone"]) == json.loads(json.dumps({"name": "swinv2_tiny", **SWIN}))
    again = vtdense.load_backbone(path)
    assert again.load_report.container == "safetensors" and again.load_report.format == "vtdense"
    _same(model, again)
    # the torch.save files of earlier vtdense versions
    old = tmp_path / "old.pth"
    torch.save({"vtdense_backbone": {"name": "swinv2_tiny", **SWIN}, "state_dict": model.state_dict()}, old)
    _same(model, vtdense.load_backbone(old))
    with pytest.raises(CheckpointError, match="save_backbone"):
        torch.save(model.state_dict(), tmp_path / "plain.pth")
        vtdense.load_backbone(tmp_path / "plain.pth")
    # load_pretrained of a saved file: its layout is vtdense's by its config, output norms or not
    bare = vtdense.save_backbone(vtdense.create_backbone("swin_tiny", **SWIN, out_norm=False), tmp_path / "bare.safetensors")
    assert vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **SWIN, out_norm=False), bare).format == "vtdense"
    # a file from a later vtdense, with an option this one does not know: its weights still load
    from vtdense.checkpoints.io import write_safetensors

    future = tmp_path / "future.safetensors"
    write_safetensors(future, model.state_dict(), {"vtdense_backbone": json.dumps({"name": "swinv2_tiny", **SWIN, "new_option": 1})})
    report = vtdense.load_pretrained(vtdense.create_backbone("swinv2_tiny", **SWIN), future)
    assert report == ([], []) and report.source_window is None
    with pytest.raises(ValueError, match="JSON"):
        bad = vtdense.create_backbone("swin_tiny", **SWIN)
        bad.config["window_size"] = object()
        vtdense.save_backbone(bad, tmp_path / "bad.safetensors")


def test_larger_window_reports_why(tmp_path: Path, hub_cache) -> None:  # noqa: F811
    v2 = vtdense.save_backbone(randomize_(vtdense.create_backbone("swinv2_tiny", **SWIN), seed=4), tmp_path / "v2.safetensors")
    wide = vtdense.load_backbone(v2, window_size=8)  # V2: pretrained window set from the file
    assert {m.pretrained_window_size for m in wide.modules() if hasattr(m, "cpb_mlp")} == {(4, 4)}
    assert any("normalised by pretrained_window_size=4" in n for n in wide.load_report.notes)
    plain = vtdense.create_backbone("swinv2_tiny", **{**SWIN, "window_size": 8})
    report = vtdense.load_pretrained(plain, v2)
    assert any("pass pretrained_window_size=4" in n for n in report.notes)
    assert "pass pretrained_window_size=4" in str(report)
    # V1: bias tables resized, each listed with the reason
    v1 = vtdense.save_backbone(vtdense.create_backbone("swin_tiny", **SWIN), tmp_path / "v1.safetensors")
    report = vtdense.load_backbone(v1, window_size=6).load_report
    assert len(report.resized) == sum(SWIN["depths"])
    key, old, new, why = report.resized[0]
    assert key.endswith("relative_position_bias_table") and old == (49, 1) and new == (121, 1) and "bicubic" in why
    assert "resized layers.*.blocks.*.attn.relative_position_bias_table" in str(report)
    # MViTv2 tables resampled for another img_size
    mv = vtdense.save_backbone(vtdense.create_backbone("mvitv2_tiny", **MVIT), tmp_path / "mv.safetensors")
    report = vtdense.load_backbone(mv, img_size=448).load_report
    assert report.resized and all("rel-pos" in why for *_, why in report.resized)
    assert not any("windowed blocks" in n for n in report.notes)  # global attention: no second resampling
    mvw = vtdense.save_backbone(vtdense.create_backbone("mvitv2_tiny", **MVIT, window_size=16), tmp_path / "mvw.safetensors")
    notes = vtdense.load_backbone(mvw, img_size=448).load_report.notes
    assert len(notes) == 1 and "build with the checkpoint's img_size" in notes[0]
    # and a vtdense file from the Hub
    hub_cache("me/vt", {"model.safetensors": v2.read_bytes()})
    _same(vtdense.load_backbone(v2), vtdense.load_backbone("me/vt"))


def test_format_detection() -> None:
    from timm.models.swin_transformer import SwinTransformer as TimmSwin

    cfg = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=7)
    timm_sd = TimmSwin(img_size=224, num_classes=3, **cfg).state_dict()
    official = {re.sub(r"layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k): v for k, v in timm_sd.items()}
    feats = timm.create_model("swin_tiny_patch4_window7_224", features_only=True, pretrained=False, **cfg).state_dict()
    cases = {"timm": timm_sd, "official": {"model": official}, "timm features_only": feats}
    for expected, sd in cases.items():
        report = vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **cfg), sd)
        assert report.format == expected
    # the official layout under mmdet's prefix, with an mmdet detector's neck and heads
    # (Swin-Transformer-Object-Detection): the backbone loads; the rest is named neck / head
    heads = {"neck.fpn_convs.0.conv.weight": torch.zeros(1), "rpn_head.rpn_cls.weight": torch.zeros(1),
             "roi_head.bbox_head.fc_cls.weight": torch.zeros(1)}
    det = {**{f"backbone.{k}": v for k, v in official.items()}, **heads}
    report = vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **cfg), {"state_dict": det})
    assert report.format == "official"
    assert {k: why for k, why in report.dropped if k in heads} == dict.fromkeys(heads, "not part of the backbone (neck / head)")
    # a timm model held as ``self.model`` by a user's own LightningModule
    wrapped = vtdense.create_backbone("swin_tiny", **cfg)
    report = vtdense.load_pretrained(wrapped, {"state_dict": {f"model.{k}": v for k, v in timm_sd.items()}})
    assert report.format == "timm" and torch.equal(wrapped.state_dict()["patch_embed.proj.weight"], timm_sd["patch_embed.proj.weight"])
    with torch.device("meta"):  # key names suffice (loading torchvision layouts: tests/test_swin.py)
        tv = torchvision.models.swin_t().state_dict()
        assert detect_format(tv, vtdense.create_backbone("swin_tiny")) == "torchvision"
    own = vtdense.create_backbone("swin_tiny", **cfg)
    assert vtdense.load_pretrained(own, own.state_dict()).format == "vtdense"
    mv = vtdense.create_backbone("mvitv2_tiny", **MVIT)
    flat = to_flat({k: v for k, v in mv.state_dict().items() if not k.startswith("out_norms.")}, mv.depths, True)
    assert vtdense.load_pretrained(mv, {"model_state": flat}).format == "mvit (original)"


def test_format_detection_of_bare_mmdet_mvitv2_and_task_layouts() -> None:
    """mmdet's converted ImageNet backbones (``swin2mmdet``) have no ``backbone.`` prefix, only
    ``stages.*``; MViTv2 timm names vs vtdense's own (output norms); the original flat layout
    under a ``model.`` prefix; Lightning checkpoints of vtdense's tasks. Each detected, and the
    bare mmdet layout loads (key names suffice for the rest: their loading is tested elsewhere)."""
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    from test_swin import to_mmdet

    src = randomize_(vtdense.create_backbone("swin_tiny", **SWIN), seed=6)
    bare = to_mmdet(src.state_dict(), prefix="")
    assert not any(k.startswith("backbone.") for k in bare)
    dst = vtdense.create_backbone("swin_tiny", **SWIN)
    report = vtdense.load_pretrained(dst, bare)
    assert report == ([], []) and report.format == "mmdet"
    _same(src, dst)
    assert detect_format({f"model.encoder.backbone.{k}": v for k, v in src.state_dict().items()}, dst) == "vtdense task checkpoint"
    with torch.device("meta"):
        mv = vtdense.create_backbone("mvitv2_tiny", **MVIT)
        sd = mv.state_dict()
        ref = MultiScaleVit(MultiScaleVitCfg(depths=MVIT["depths"], embed_dim=16, num_heads=1), img_size=224, num_classes=3)
    assert detect_format(ref.state_dict(), mv) == "timm"
    assert detect_format(sd, mv) == "vtdense"
    flat = to_flat({k: v for k, v in sd.items() if not k.startswith("out_norms.")}, mv.depths, True)
    assert detect_format({f"model.{k}": v for k, v in flat.items()}, mv) == "mvit (original)"
    assert detect_format({f"model.backbone.body.{k}": v for k, v in sd.items()}, mv) == "vtdense task checkpoint"


@pytest.mark.parametrize("name,kwargs", [("swin_tiny", SWIN), ("mvitv2_tiny", MVIT)])
def test_task_checkpoints_give_their_backbone(tmp_path: Path, name: str, kwargs: dict) -> None:
    """A Lightning checkpoint of ``SegmentationTask`` (SMP encoder: ``model.encoder.backbone.``)
    or ``DetectionTask`` (FPN body: ``model.backbone.body.``): the backbone part loads, bit for
    bit; the decoder, auxiliary head, FPN and detection head are dropped as not the backbone's."""
    from vtdense.tasks.detection import DetectionTask
    from vtdense.tasks.segmentation import SegmentationTask

    seg = SegmentationTask(backbone=name, backbone_kwargs=kwargs, num_classes=3, arch_kwargs={"decoder_channels": 16}, aux_channels=8)
    det = DetectionTask(backbone=name, backbone_kwargs=kwargs, num_classes=2, head="retinanet", fpn_channels=32)
    for task, body in ((seg, seg.model.encoder.backbone), (det, det.model.backbone.body)):
        randomize_(body, seed=7)
        path = tmp_path / "last.ckpt"
        torch.save({"state_dict": task.state_dict(), "hyper_parameters": {"backbone": name}, "epoch": 1}, path)
        # a RetinaNet's backbone emits strides 8-32 only (no stage-1 output norm): load it into the same
        dst = vtdense.create_backbone(name, **kwargs, **({"out_indices": (1, 2, 3)} if task is det else {}))
        report = vtdense.load_pretrained(dst, path)
        assert report == ([], []) and report.format == "vtdense task checkpoint"
        _same(body, dst, size=(1, 3, 64, 64))
        not_backbone = {k for k in task.state_dict() if not k.startswith(("model.encoder.backbone.", "model.backbone.body."))}
        assert not_backbone and {k for k, _ in report.dropped} == not_backbone
        # RetinaNet's ``model.head.*`` too: a detection head, not a classifier
        assert {why for _, why in report.dropped} == {"not part of the backbone (neck / head)"}
        assert det is not task or any(k.startswith("model.head.") for k, _ in report.dropped)


@pytest.mark.parametrize("name,kwargs", [("swin_tiny", SWIN), ("mvitv2_tiny", MVIT)])
def test_model_state_dicts_give_their_backbone(name: str, kwargs: dict) -> None:
    """The state dict of a model alone (``build_segmentor``: ``encoder.backbone.``; ``build_detector``:
    ``backbone.body.``; the SMP encoder: ``backbone.``) loads its backbone bit for bit; the rest is
    reported as not the backbone's."""
    from vtdense.models.detection import build_detector
    from vtdense.models.segmentation import build_segmentor

    seg = build_segmentor("fpn", name, num_classes=3, backbone_kwargs=kwargs)
    det = build_detector(vtdense.create_backbone(name, **kwargs), "retinanet", num_classes=2)
    for model, body, prefix, fmt in ((seg, seg.encoder.backbone, "encoder.backbone.", "vtdense model"),
                                     (det, det.backbone.body, "backbone.body.", "vtdense model"),
                                     (seg.encoder, seg.encoder.backbone, "backbone.", "vtdense")):
        randomize_(body, seed=9)
        dst = vtdense.create_backbone(name, **kwargs)
        report = vtdense.load_pretrained(dst, model.state_dict())
        assert report == ([], []) and report.format == fmt, prefix
        _same(body, dst, size=(1, 3, 64, 64))
        rest = {k for k in model.state_dict() if not k.startswith(prefix)}
        assert {k for k, _ in report.dropped} == rest
        if prefix != "backbone.":
            assert rest and {why for _, why in report.dropped} == {"not part of the backbone (neck / head)"}


def test_mmseg_checkpoint_heads_are_dropped_as_not_the_backbone() -> None:
    """An mmseg UPerNet checkpoint: ``backbone.`` plus ``decode_head.`` and ``auxiliary_head.``;
    both heads are reported as not the backbone's, the backbone loads."""
    from test_swin import to_mmdet

    src = randomize_(vtdense.create_backbone("swin_tiny", **SWIN), seed=8)
    ckpt = {**to_mmdet(src.state_dict()), "decode_head.conv_seg.weight": torch.zeros(3, 8, 1, 1),
            "auxiliary_head.conv_seg.weight": torch.zeros(3, 8, 1, 1), "auxiliary_head.convs.0.bn.running_mean": torch.zeros(8)}
    dst = vtdense.create_backbone("swin_tiny", **SWIN)
    report = vtdense.load_pretrained(dst, {"state_dict": ckpt, "meta": {"mmseg_version": "1.2.2"}})
    assert report == ([], []) and report.format == "mmdet"
    assert dict(report.dropped) == {k: "not part of the backbone (neck / head)" for k in ckpt if k.endswith("head") or "_head." in k}
    _same(src, dst)


def _tv_swin_v2(**kw) -> torch.nn.Module:
    """A small torchvision Swin V2 (``swin_v2_t``'s blocks and merging) with random weights."""
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1, 2, 1], num_heads=[1, 2, 2, 4], window_size=[4, 4],
                            block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2, num_classes=3)
    return randomize_(model, seed=10).eval()


def test_load_report_accounts_for_every_checkpoint_tensor() -> None:
    """Each checkpoint tensor is in exactly one place: loaded as it is (``loaded``), used to derive
    or resize a model tensor (``derived`` / ``resized``, never also ``dropped``), or dropped with its
    reason; and the summary says so in a few lines."""
    from test_swin import to_mmdet
    from vtdense.checkpoints.convert import convert_state_dict

    def partition(report, raw: dict) -> tuple[set, set, set]:
        loaded = [a for a, _ in report.loaded]
        dropped = [k for k, _ in report.dropped]
        assert len(set(loaded)) == len(loaded) and len(set(dropped)) == len(dropped) and not set(loaded) & set(dropped)
        return set(loaded), set(dropped), set(raw) - set(loaded) - set(dropped)

    # torchvision V2: one qkv.bias per block -> q_bias and v_bias; index / coordinate buffers recomputed
    tv = _tv_swin_v2().state_dict()
    v2 = vtdense.create_backbone("swinv2_tiny", **SWIN, out_norm=False)
    report = vtdense.load_pretrained(v2, tv)
    assert report == ([], []) and report.format == "torchvision" and report.resized == []
    loaded, dropped, used = partition(report, tv)
    qkv = {k for k in tv if k.endswith("attn.qkv.bias")}
    assert used == qkv and len(qkv) == 5
    blocks = [f"layers.{s}.blocks.{b}.attn." for s, d in enumerate(SWIN["depths"]) for b in range(d)]
    assert sorted(k for k, _ in report.derived) == sorted(b + p for b in blocks for p in ("q_bias", "v_bias"))
    reasons = dict(report.dropped)
    assert {k for k, why in reasons.items() if why == "derived buffer, recomputed by vtdense"} == {
        k for k in tv if k.endswith(("relative_position_index", "relative_coords_table"))}
    assert {k for k, why in reasons.items() if why == "classification head / final norm"} == {"head.weight", "head.bias", "norm.weight", "norm.bias"}
    text = report.summary()
    assert f"{len(loaded)} tensors loaded as they are ({len(loaded)} renamed), 0 resized, 10 derived, {len(dropped)} dropped" in text
    assert "dropped features.*.*.attn.relative_position_index (x5): derived buffer, recomputed by vtdense" in text
    assert "derived layers.*.blocks.*.attn.q_bias (x5): a third of the checkpoint's qkv.bias" in text

    # mmdet: the merging tensors are permuted (derived), the rest renamed
    src = randomize_(vtdense.create_backbone("swin_tiny", **SWIN), seed=11)
    mm = to_mmdet(src.state_dict())
    report = vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **SWIN), mm)
    loaded, dropped, used = partition(report, mm)
    assert dropped == set() and used == {k for k in mm if ".downsample." in k} and len(used) == 9
    assert sorted(k for k, _ in report.derived) == sorted(k for k in src.state_dict() if ".downsample." in k)

    # a window change (V1): tables resized, not loaded and not dropped; at the same window, loaded as they are
    sd = randomize_(vtdense.create_backbone("swin_tiny", **SWIN), seed=12).state_dict()
    tables = {k for k in sd if k.endswith("relative_position_bias_table")}
    report = vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **{**SWIN, "window_size": 6}), sd)
    loaded, dropped, used = partition(report, sd)
    assert dropped == set() and used == tables == {k for k, *_ in report.resized}
    same = vtdense.create_backbone("swin_tiny", **SWIN)
    report = vtdense.load_pretrained(same, sd)
    assert report.resized == [] and set(report.loaded) == {(k, k) for k in sd}
    assert "(0 renamed)" in report.summary() and "renamed, e.g." not in report.summary()
    # the report is only written during its own load
    convert_state_dict(sd, vtdense.create_backbone("swin_tiny", **{**SWIN, "window_size": 6}))
    assert report.resized == []

    # timm classification weights into a model with output norms: 8 norms kept, listed compressed
    from timm.models.swin_transformer import SwinTransformer as TimmSwin

    report = vtdense.load_pretrained(vtdense.create_backbone("swin_tiny", **SWIN), TimmSwin(img_size=64, num_classes=3, **SWIN).state_dict())
    assert len(report.missing) == 8
    assert "kept initialisation (not in checkpoint): out_norms.stage1.weight, " in report.summary()
    assert "out_norms.stage3.bias, ... (2 more)" in report.summary()


def test_load_backbone_sets_the_pretrained_window_only_where_it_keeps_a_meaning(tmp_path: Path) -> None:
    """``load_backbone(window_size=...)`` of a Swin V2 file: a file already fine-tuned from a smaller
    window (saved with its ``pretrained_window_size``) keeps that one at any new window (the
    Log-CPB coordinates were normalised by it throughout); reloading at the saved window adds none."""

    def pws(model) -> set:
        return {m.pretrained_window_size for m in model.modules() if hasattr(m, "cpb_mlp")}

    tuned = vtdense.create_backbone("swinv2_tiny", **{**SWIN, "window_size": 8, "pretrained_window_size": 4})
    path = vtdense.save_backbone(randomize_(tuned, seed=13), tmp_path / "tuned.safetensors")
    wider = vtdense.load_backbone(path, window_size=12)
    assert pws(wider) == {(4, 4)} and wider.config["pretrained_window_size"] == 4
    plain = vtdense.save_backbone(vtdense.create_backbone("swinv2_tiny", **SWIN), tmp_path / "plain.safetensors")
    again = vtdense.load_backbone(plain, window_size=4)
    assert pws(again) == {(0, 0)} and not again.config.get("pretrained_window_size")
    assert vtdense.load_backbone(plain, window_size=8).config["pretrained_window_size"] == [4, 4]


@pytest.mark.parametrize("family,kwargs", [("swin_tiny", SWIN), ("mvitv2_tiny", MVIT)])
def test_a_whole_checkpoint_loads_into_a_backbone_with_fewer_outputs(family: str, kwargs: dict, tmp_path: Path) -> None:
    """A checkpoint of every stage and output norm loads strictly into a backbone built with fewer
    outputs (the stages it does not build are skipped) or without output norms, by
    ``create_backbone(pretrained=)`` and ``load_backbone`` alike; the rest loads as it is."""
    full = randomize_(vtdense.create_backbone(family, **kwargs), seed=21)
    path = vtdense.save_backbone(full, tmp_path / "full.safetensors")
    for options in ({"out_indices": (0, 1, 2)}, {"out_indices": (1, 2, 3)}, {"out_norm": False}):
        for model in (vtdense.create_backbone(family, pretrained=path, **kwargs, **options), vtdense.load_backbone(path, **options)):
            own = model.state_dict()
            assert own and all(torch.equal(v, full.state_dict()[k]) for k, v in own.items() if "relative_position_index" not in k)
            built = {k.split(".")[1] for k in own if k.startswith(("layers.", "stages."))}
            dropped = {k for k, _ in model.load_report.dropped}
            assert dropped == {k for k in full.state_dict() if k not in own}, options
            assert len(built) == (3 if options.get("out_indices") == (0, 1, 2) else 4)


def test_swin_v1_tables_of_windows_shrunk_to_small_maps_keep_their_values() -> None:
    """timm sizes the bias table of a stage whose map is smaller than the window (built at 96 px
    with window 6: the last stage's 3x3 map) for the shrunk window. Loaded into a window-6
    vtdense Swin, that table goes to the centre of the 6x6 one, so at the size the checkpoint
    was made for the features are timm's (a bicubic resize, right for a real change of window,
    stretched it: 0.08 off)."""
    _last_table_centred_as_timm(6, 96, 25, 121)


def _last_table_centred_as_timm(window: int | tuple[int, int], img: int, old_rows: int, new_rows: int) -> torch.nn.Module:
    """A timm Swin V1 at ``window`` on ``img`` px whose last stage's table timm sized for a shrunk
    window (``old_rows``), loaded at the same window: that table is centred in the model's
    (``new_rows``), and the features are timm's. Returns the vtdense model."""
    from timm.models.swin_transformer import SwinTransformer as TimmSwin

    cfg = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=window)
    ref = randomize_(TimmSwin(img_size=img, num_classes=0, **cfg), seed=8).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    ours = vtdense.create_backbone("swin_tiny", out_norm=False, pretrained=ref.state_dict(), **cfg).eval()
    (key, old, new, why), = ours.load_report.resized
    assert key == "layers.3.blocks.0.attn.relative_position_bias_table" and old == (old_rows, 1) and new == (new_rows, 1) and "centre" in why
    x = torch.randn(1, 3, img, img)
    with torch.no_grad():
        for want, got in zip(ref.forward_intermediates(x, intermediates_only=True), ours(x).values()):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return ours


def test_swin_v1_non_square_windows_load_as_timm_and_from_vtdense_files(tmp_path: Path) -> None:
    """A timm Swin at window (7, 14) on 224 px shrinks the last stage's to 7x7 and sizes its table
    for that: loaded at the same window, the table goes to the centre of the 7x14 one and the
    features are timm's (it was stretched, 0.05 off). A vtdense file saved at (7, 14) reloads with
    another window: its config gives the tables' window, which their row count cannot."""
    ours = _last_table_centred_as_timm((7, 14), 224, 169, 351)
    path = vtdense.save_backbone(ours, tmp_path / "w7x14.safetensors")
    wider = vtdense.load_backbone(path, window_size=14)
    table = "layers.0.blocks.0.attn.relative_position_bias_table"
    from vtdense.layers.position import resize_bias_table

    torch.testing.assert_close(wider.state_dict()[table], resize_bias_table(ours.state_dict()[table], (7, 14), (14, 14)))
    assert all("window 7x14 -> 14x14 (bicubic)" in why for *_, why in wider.load_report.resized)


def test_a_tensor_stored_under_two_keys_is_reported_under_the_key_it_loads_from() -> None:
    """A checkpoint holding one tensor under two keys (its own and an alias the model lacks): the
    report says it loaded from its own key and names the alias as the same tensor, instead of
    calling the loaded key dropped."""
    kwargs = dict(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4)
    sd = dict(vtdense.create_backbone("swin_tiny", **kwargs).state_dict())
    sd["ema.patch_embed.proj.weight"] = sd["patch_embed.proj.weight"]  # the same tensor object
    dst = vtdense.create_backbone("swin_tiny", **kwargs)
    report = vtdense.load_pretrained(dst, sd, strict=False)
    assert ("patch_embed.proj.weight", "patch_embed.proj.weight") in report.loaded
    dropped = dict(report.dropped)
    assert "patch_embed.proj.weight" not in dropped
    assert dropped["ema.patch_embed.proj.weight"] == "the same tensor as patch_embed.proj.weight, loaded"
    assert torch.equal(dst.patch_embed.proj.weight, sd["patch_embed.proj.weight"])


@pytest.mark.parametrize("in_chans", [1, 2, 4])
@pytest.mark.parametrize("family", ["swin", "mvitv2"])
def test_an_rgb_checkpoint_loads_into_other_input_channels_as_timm_adapts_it(family: str, in_chans: int, tmp_path: Path) -> None:
    from timm.models import adapt_input_conv

    name, kwargs = ("swin_tiny", SWIN) if family == "swin" else ("mvitv2_tiny", MVIT)
    src = randomize_(vtdense.create_backbone(name, **kwargs), seed=3)
    dst = vtdense.create_backbone(name, **kwargs, in_chans=in_chans)
    report = vtdense.load_pretrained(dst, src.state_dict())
    key = "patch_embed.proj.weight"
    expected = adapt_input_conv(in_chans, src.state_dict()[key])
    assert dst.state_dict()[key].shape[1] == in_chans
    torch.testing.assert_close(dst.state_dict()[key], expected, rtol=0, atol=0)
    for k, v in src.state_dict().items():
        if k != key:
            assert torch.equal(dst.state_dict()[k], v), k
    assert [(k, old, new) for k, old, new, _ in report.resized] == [(key, tuple(src.state_dict()[key].shape), tuple(expected.shape))]
    assert f"in_chans={in_chans}" in report.summary()
    vtdense.save_backbone(src, tmp_path / "rgb.safetensors")  # the same through load_backbone's overrides
    again = vtdense.load_backbone(tmp_path / "rgb.safetensors", in_chans=in_chans)
    assert torch.equal(again.state_dict()[key], expected)
    # a 2-channel checkpoint is no RGB one: one error naming the key, not a guess
    two = vtdense.create_backbone(name, **kwargs, in_chans=2)
    with pytest.raises(CheckpointError, match="patch_embed.proj.weight: checkpoint .*2.* vs model .*4"):
        vtdense.load_pretrained(vtdense.create_backbone(name, **kwargs, in_chans=4), two.state_dict())


def _official_swinv2_file(src: torch.nn.Module, path: Path) -> Path:
    """A timm Swin V2 in the official release layout (merging ends a stage), with the per-block
    ``relative_coords_table`` / ``relative_position_index`` buffers the official code persists."""
    sd = {re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m[1]) - 1}.downsample", k): v for k, v in src.state_dict().items()}
    for name, module in src.named_modules():
        if isinstance(getattr(module, "relative_coords_table", None), torch.Tensor):
            sd[f"{name}.relative_coords_table"] = module.relative_coords_table
            sd[f"{name}.relative_position_index"] = module.relative_position_index
    torch.save({"model": sd}, path)
    return path


@pytest.mark.parametrize("pretrained_windows", [(0, 0, 0, 0), (12, 12, 12, 6)], ids=["own", "fixed"])
def test_an_official_swinv2_file_sets_the_pretrained_window_its_buffers_record(tmp_path: Path, pretrained_windows: tuple) -> None:
    """Official Swin V2 files carry no config, but their Log-CPB buffers say which window normalised
    the coordinates: fine-tuned at a larger window, vtdense gives what timm gives with the
    checkpoint's windows as ``pretrained_window_sizes`` (window 8 files; a window12to16-like file
    whose last stage was normalised by 6)."""
    small = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4))
    window = 8 if pretrained_windows[0] == 0 else 12
    timm_v2 = lambda w, pws: timm.create_model(  # noqa: E731
        "swinv2_tiny_window8_256", pretrained=False, num_classes=0, window_size=w, pretrained_window_sizes=pws, **small)
    src = randomize_(timm_v2(window, pretrained_windows), seed=5, std=0.3).eval()
    path = _official_swinv2_file(src, tmp_path / "official.pth")
    expected = (8,) * 4 if pretrained_windows[0] == 0 else pretrained_windows
    ref = timm_v2(16, expected).eval()
    ref.load_state_dict(src.state_dict(), strict=False)  # buffers recomputed for window 16; no table to resize
    ours = vtdense.create_backbone("swinv2_tiny", pretrained=str(path), **small, window_size=16, out_norm=False).eval()
    assert [tuple(s.blocks[0].attn.pretrained_window_size) for s in ours.layers] == [(p, p) for p in expected]
    assert any("set from the checkpoint" in n for n in ours.load_report.notes), ours.load_report.notes
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        got = list(ours(x).values())
        want = ref.forward_intermediates(x, indices=4, norm=False, intermediates_only=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # loaded into a model left at 0: the note says what to pass
    plain = vtdense.create_backbone("swinv2_tiny", **small, window_size=16)
    report = vtdense.load_pretrained(plain, path)
    assert any(f"pass pretrained_window_size={expected[0] if len(set(expected)) == 1 else '(12, 12, 12, 6)'}" in n for n in report.notes), report.notes
    # buffers that are no reference table say nothing (and the load goes on as before)
    bad = torch.load(path, weights_only=True)
    bad["model"] = {k: (torch.rand_like(v) if k.endswith("relative_coords_table") else v) for k, v in bad["model"].items()}
    torch.save(bad, tmp_path / "bad.pth")
    assert vtdense.create_backbone("swinv2_tiny", pretrained=str(tmp_path / "bad.pth"), **small,
                                   window_size=window).load_report.source_log_cpb_windows is None


def test_a_checkpoint_of_another_family_is_named_in_the_error(tmp_path: Path) -> None:
    v1, v2 = (vtdense.create_backbone(n, **SWIN) for n in ("swin_tiny", "swinv2_tiny"))
    mvit = vtdense.create_backbone("mvitv2_tiny", **MVIT)
    torch.save(v1.state_dict(), tmp_path / "v1.pth")
    with pytest.raises(CheckpointError, match=r"(?s)v1\.pth does not fit.*keys are those of a Swin V1 model: load it into a swin_\* backbone"):
        vtdense.load_pretrained(v2, tmp_path / "v1.pth")
    with pytest.raises(CheckpointError, match="keys are those of a Swin V2 model: load it into a swinv2_"):
        vtdense.load_pretrained(v1, v2.state_dict())
    with pytest.raises(CheckpointError, match="keys are those of an MViTv2 model: load it into an mvitv2_"):
        vtdense.load_pretrained(v1, mvit.state_dict())
    with pytest.raises(CheckpointError, match="keys are those of a Swin V1 model") as caught:
        vtdense.load_pretrained(mvit, v1.state_dict())
    # a checkpoint of the right family that does not fit gets no such line
    deeper = vtdense.create_backbone("swin_tiny", **{**SWIN, "depths": (1, 1, 3, 1)})
    with pytest.raises(CheckpointError) as caught:
        vtdense.load_pretrained(v1, deeper.state_dict())
    assert "keys are those of" not in str(caught.value)
