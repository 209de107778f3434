"""The robust starter text tower: train the ``robust-starter`` recipe (resumable) and save its tuned
layers as the package ships them (``training/export/starter.ROBUST_LAYERS``), with a card that
records the recipe, the data and the run."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from paraseek.core.settings import Settings
from paraseek.training.export.starter import save_tuned_layers
from paraseek.training.recipe import load_recipe
from paraseek.training.trainer import Trainer

RECIPE = "robust-starter"
# how the shipped layers were measured; a user's own run is measured with the same command
MEASURE_WITH = ("paraseek eval compare --model robust=BUNDLE --images coco-mini/captions_val2017.json "
                "--pairs paraphrase/cxc_dev_pairs.tsv --sts sts/sts-dev.csv")


def train_robust_layers(settings: Settings, run_dir: Path, overrides: Sequence[str] = (), progress: bool = True,
                        measured: dict | None = None) -> Path:
    """Train (or resume) the recipe in ``run_dir``; write ``robust-starter.safetensors`` + card there."""
    recipe = load_recipe(RECIPE, list(overrides))
    trainer = Trainer(recipe, run_dir)
    trainer.fit(progress=progress)
    # SentenceText keeps the MiniLM tower as ``encoder``: the starter loads the keys without it
    state = {name.removeprefix("encoder."): value for name, value in trainer.final_state().items()}
    data = trainer.data
    card = {
        "recipe": recipe.model_dump(mode="json"), "steps": trainer.step,
        "data": {
            "image_term": f"{len(data.captions)} photos with {sum(map(len, data.captions))} captions "
                          f"({recipe.data.image_embeddings or recipe.data.captions})",
            "text_terms": f"{len(data.text_groups or [])} paraphrase sets of human captions ({recipe.data.text_captions})",
            "licence": "COCO captions CC BY 4.0 (paraphrase/data/ATTRIBUTION.md)",
        },
        "measured": measured, "measure_with": MEASURE_WITH,
    }
    path = Path(run_dir) / "robust-starter.safetensors"
    save_tuned_layers(state, path, card)
    return path
