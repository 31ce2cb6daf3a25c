"""Exported models as MLflow models, and as versions in the MLflow Model Registry.

A model folder in timm's layout (:mod:`pretrain.timm_folder`) is packaged with
``mlflow.pyfunc.save_model`` as a "model from code": the code is :mod:`pretrain.pyfunc_model`
(copied into the package), the weights are the folder itself. ``mlflow.pyfunc.load_model`` runs
that file and reads safetensors; nothing is unpickled, unlike a pickled ``PythonModel``.

The package is written locally, under the run's ``tracking/artifacts/model/``, and reaches
MLflow the way every artifact of a run does: the tracker's thread uploads it, retrying while
the server is down, and ``launch/upload_spool.py`` sends it after the job if need be
(:mod:`pretrain.mlflow_delivery`). On an MLflow 3 server it becomes a *logged model* of the
run (its Models tab, the run's "Logged models"), marked READY once every file is up; a server
before MLflow 3 keeps it among the run's artifacts. ``runs:/<run id>/model`` loads it either
way (from MLflow 3 on, the run's newest logged model of that name, even one still uploading:
``models:/NAME/VERSION`` names a finished one). The registration (``tracking.register_as``)
is queued in the run's ``run.json`` and made once the upload is complete, so a registered
version never points at a half-uploaded model, and a registration interrupted by a crash is
not made twice.
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
             tags: Optional[dict] = None, description: Optional[str] = None,
             model_id: Optional[str] = None) -> str:
    """A new version of registered model ``name`` from the logged model ``model_id`` (MLflow 3),
    else from ``runs:/<run_id>/<artifact_path>``, with ``tags`` and ``description`` (which
    weights these are); the version already made from that model when there is one. Returns
    the version."""
    source, remote = f"runs:/{run_id}/{artifact_path}", False
    if model_id:
        # A store opened by the client itself (sqlite, a folder, a database) resolves models:/
        # through the process's default tracking URI, not the client's; a server (or a
        # service: databricks) does it right, and the model's location needs nothing
        from pretrain.tracking_store import opened_in_process
        remote = not opened_in_process(str(getattr(client, "tracking_uri", "")))
        source = f"models:/{model_id}" if remote else \
            client.get_logged_model(model_id).artifact_location
    try:
        client.create_registered_model(name)
    except Exception as e:  # noqa: BLE001 -- it exists already (or the next call says why)
        if "RESOURCE_ALREADY_EXISTS" not in str(getattr(e, "error_code", "")) \
                and "already exists" not in str(e):
            raise
    made = [mv for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
            if mv.source == source]
    if made:
        version = str(made[0].version)
    else:
        linked = {"model_id": model_id} if model_id else {}  # (an MLflow 2 client has no such)
        version = str(client.create_model_version(
            name, source=source, run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()},
            description=description, **linked).version)
        log.info("registered model '%s' version %s: mlflow.pyfunc.load_model('models:/%s/%s')",
                 name, version, name, version)
    if model_id and not remote:  # (a server names it on the model itself)
        _list_version(client, model_id, name, int(version))
    return version


def _list_version(client, model_id: str, name: str, version: int) -> None:
    """Name the version on its logged model, as an MLflow server does: the Models tab shows a
    model's registered versions from this tag."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS
    listed = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
    entry = {"name": name, "version": version}
    if entry not in listed:
        client.set_logged_model_tags(model_id,
                                     {MLFLOW_MODEL_VERSIONS: json.dumps(listed + [entry])})


def new_logged_model(client, run_id: str, name: str, params: dict, tags: dict) -> Optional[str]:
    """The id of a new logged model ``name`` of run ``run_id``, PENDING until
    :func:`finish_logged_model`; None where the server cannot hold one (before MLflow 3, or it
    refuses): the model's files are then artifacts of the run, as MLflow 2 kept models."""
    from pretrain.mlflow_delivery import is_page_not_found, is_permanent
    from pretrain.spool import one_line
    if not hasattr(client, "create_logged_model"):  # an MLflow 2 client
        return None
    try:
        return client.create_logged_model(
            client.get_run(run_id).info.experiment_id, name=name, source_run_id=run_id,
            params={k: str(v) for k, v in params.items()},
            tags={k: str(v) for k, v in tags.items()}).model_id
    except Exception as e:  # noqa: BLE001
        if is_page_not_found(e):
            # the answer of a server without this endpoint, or of a proxy whose server is away:
            # the run's own page tells them apart (it raises in the second case: retried)
            client.get_run(run_id)
        elif not is_permanent(e):
            raise
        log.info("the MLflow server keeps no logged models (%s); the model is the run's "
                 "artifact runs:/%s/%s", one_line(e), run_id, name)
        return None


def finish_logged_model(client, run_id: str, model_id: str, name: str,
                        step: Optional[int]) -> None:
    """Mark the logged model READY and list it among the run's outputs at ``step`` (the UI's
    "Logged models" of the run), once every file is up; ``step`` None: FAILED, a package
    replaced before it was complete. Safe to call again after a crash."""
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    if step is None:
        client.finalize_logged_model(model_id, "FAILED")
        return
    # still there? An MLflow client keeps uploading to a model deleted meanwhile (it caches
    # where its files go), and a server answers the registration of one with a 500 (an outage)
    client.get_logged_model(model_id)
    client.finalize_logged_model(model_id, "READY")
    run = client.get_run(run_id)
    if model_id not in {o.model_id for o in (run.outputs.model_outputs if run.outputs else [])}:
        client.log_outputs(run_id, [LoggedModelOutput(model_id, step=step)])
    # a crash between a model's creation and run.json's record of it left that one PENDING,
    # and the package went to another: it ends FAILED, not pending in the Models tab forever
    for lm in client.search_logged_models([run.info.experiment_id],
                                          filter_string=f"name = '{name}'"):
        if lm.source_run_id == run_id and lm.model_id != model_id \
                and lm.status == LoggedModelStatus.PENDING:
            client.finalize_logged_model(lm.model_id, "FAILED")
