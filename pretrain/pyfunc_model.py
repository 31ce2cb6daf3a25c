"""The MLflow model of an exported ViT: an MLflow "model from code".

MLflow stores this file beside the model's timm folder (config.json, model.safetensors,
README.md; see :mod:`pretrain.timm_folder`) and runs it when the model is loaded, so loading
unpickles nothing: the code is this file, the weights are safetensors. It imports only timm,
torch, numpy, pandas and PIL, not vitscale, so the model loads wherever those are installed::

    model = mlflow.pyfunc.load_model("models:/NAME/1")
    model.predict(images)   # images: uint8 array (N, H, W, 3), RGB, any H and W

The images go through timm's eval transform built from the folder's ``pretrained_cfg``, which
is the training run's own (resize, centre crop, normalisation). A classifier returns a
DataFrame with one row per image: ``class`` (the index), ``label`` (its name where the dataset
had names, else the index as text) and ``score`` (softmax probability); a backbone (a
pretraining export, ``num_classes=0``) returns its features, an array (N, width).
"""
import mlflow
import numpy as np
from mlflow.pyfunc import PythonModel

# the artifact name under which the timm folder is logged beside this file
WEIGHTS_ARTIFACT = "timm_model"


class TimmImageModel(PythonModel):
    def load_context(self, context):
        import timm

        folder = context.artifacts[WEIGHTS_ARTIFACT]
        self.model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
        self.transform = timm.data.create_transform(
            **timm.data.resolve_model_data_config(self.model))
        self.labels = self.model.pretrained_cfg.get("label_names")

    # an ndarray hint: MLflow infers no schema from it (the saved signature says what goes
    # in) and stops warning, on every load, that predict has no type hints
    def predict(self, context, model_input: np.ndarray, params=None):
        import pandas as pd
        import torch
        from PIL import Image

        images = np.asarray(model_input)
        if images.ndim == 3:  # one image
            images = images[None]
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"expected RGB images as a uint8 array (N, H, W, 3), got shape "
                             f"{images.shape}")
        batch = torch.stack([self.transform(Image.fromarray(im.astype(np.uint8), "RGB"))
                             for im in images])
        with torch.inference_mode():
            out = self.model(batch).float()
        if not self.model.num_classes:
            return out.numpy()
        score, cls = out.softmax(dim=-1).max(dim=-1)
        cls = cls.tolist()
        names = self.labels if self.labels and len(self.labels) == out.shape[1] else None
        return pd.DataFrame({"class": cls,
                             "label": [names[c] if names else str(c) for c in cls],
                             "score": score.numpy().astype(np.float64)})


mlflow.models.set_model(TimmImageModel())
