"""Exported models as MLflow models, and as versions in the MLflow Model Registry.

A model folder in timm's layout (:mod:`pretrain.timm_folder`) is packaged with
``mlflow.pyfunc.save_model`` as a "model from code": the code is :mod:`pretrain.pyfunc_model`
(copied into the package), the weights are the folder itself. ``mlflow.pyfunc.load_model`` runs
that file and reads safetensors; nothing is unpickled, unlike a pickled ``PythonModel``.

The package is written locally, under the run's ``tracking/artifacts/model/``, and reaches
MLflow the way every artifact of a run does: the tracker's thread uploads it, retrying while
the server is down, and ``launch/upload_spool.py`` sends it after the job if need be
(:mod:`pretrain.mlflow_delivery`). The registration (``tracking.register_as``) is queued in the run's
``run.json`` and made once the upload is complete, so a registered version never points at a
half-uploaded model, and a registration interrupted by a crash is not made twice.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Optional, Union

log = logging.getLogger(__name__)

MODEL_ARTIFACT = "model"  # the run's artifact path: runs:/<run id>/model
CODE = Path(__file__).with_name("pyfunc_model.py")


def requirements() -> list[str]:
    """What loading needs, pinned to what wrote it (MLflow would otherwise infer them by loading
    the model in a subprocess: seconds to minutes for a ViT-H)."""
    from importlib.metadata import version
    pins = []
    for dist in ("torch", "timm", "safetensors", "numpy", "pandas", "pillow"):
        pins.append(f"{dist}=={version(dist).split('+')[0]}")  # no local tag: 2.6.0+cu124
    return pins


def package(folder: Union[str, os.PathLike], dest: Union[str, os.PathLike]) -> Path:
    """Write the MLflow model of the timm ``folder`` to ``dest`` (replaced if it exists)."""
    import numpy as np
    import mlflow.pyfunc
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema, TensorSpec

    from pretrain.pyfunc_model import WEIGHTS_ARTIFACT
    from pretrain.timm_folder import CONFIG

    folder, dest = Path(folder), Path(dest)
    config = json.loads((folder / CONFIG).read_text())
    inputs = Schema([TensorSpec(np.dtype(np.uint8), (-1, -1, -1, 3))])
    if config["num_classes"]:
        outputs = Schema([ColSpec("long", "class"), ColSpec("string", "label"),
                          ColSpec("double", "score")])
    else:
        outputs = Schema([TensorSpec(np.dtype(np.float32), (-1, config["num_features"]))])
    if dest.exists():
        shutil.rmtree(dest)
    # no progress bar in the training log (the folder is "downloaded" into the package), and
    # no advice about input examples: the signature says what goes in
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        mlflow.pyfunc.save_model(
            str(dest), python_model=str(CODE), artifacts={WEIGHTS_ARTIFACT: str(folder)},
            signature=ModelSignature(inputs=inputs, outputs=outputs),
            pip_requirements=requirements(),
            metadata={"architecture": config["architecture"],
                      "num_classes": config["num_classes"],
                      "input_size": config["pretrained_cfg"]["input_size"]})
    return dest


def register(client, run_id: str, name: str, artifact_path: str = MODEL_ARTIFACT,
             tags: Optional[dict] = None, description: Optional[str] = None) -> str:
    """A new version of registered model ``name`` from ``runs:/<run_id>/<artifact_path>``, with
    ``tags`` and ``description`` (which weights these are); the version already made from that
    run and path when there is one. Returns the version."""
    source = f"runs:/{run_id}/{artifact_path}"
    try:
        client.create_registered_model(name)
    except Exception as e:  # noqa: BLE001 -- it exists already (or the next call says why)
        if "RESOURCE_ALREADY_EXISTS" not in str(getattr(e, "error_code", "")) \
                and "already exists" not in str(e):
            raise
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if mv.source == source:
            return str(mv.version)
    version = str(client.create_model_version(
        name, source=source, run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()},
        description=description).version)
    log.info("registered model '%s' version %s: mlflow.pyfunc.load_model('models:/%s/%s')",
             name, version, name, version)
    return version
