"""Writes resume_finetune_colab.ipynb (kept as code so the notebook stays reviewable in diffs).

Run: python notebooks/make_notebook.py
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    new_markdown_cell("""# Fine-tune on Colab, lose the runtime, resume from the Hub, bit for bit

Colab runtimes disconnect. With `hf_resumable`, a `ResumableTrainer` pushes every committed checkpoint to the Hub
in the background (queued, never skipped, retried), and a brand-new runtime resumes from the newest one with
`train(resume_from_checkpoint="hf://<you>/<repo>")`. The resumed run continues **exactly**: the loss curve has
no seam, and the final weights equal those of a run that was never interrupted.

This notebook builds a tiny GPT-2 from a config and fine-tunes it on a small corpus shipped with the package, so
it runs in a minute on a CPU runtime. Set `REPO_ID` to a repo you own (and log in with `huggingface_hub.login()`)."""),
    new_code_cell("""# 1. Install (on Colab). Locally, `pip install -e .` in the repository does the same.
import sys, subprocess
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "hf_resumable"], check=True)"""),
    new_code_cell("""# 2. Parameters
import os, shutil, tempfile
REPO_ID = os.environ.get("NOTEBOOK_REPO_ID", "your-username/hf-resumable-colab-demo")
MAX_STEPS = int(os.environ.get("NOTEBOOK_MAX_STEPS", 24))
SAVE_STEPS = 4
RUNTIME_LOST_AT = int(os.environ.get("NOTEBOOK_LOST_AT", 10))   # the step at which the runtime "disconnects"
WORK = tempfile.mkdtemp(prefix="hf_resumable_colab_")"""),
    new_code_cell("""# 3. A tiny causal LM and a small corpus (nothing to download)
import torch
from transformers import TrainingArguments, TrainerCallback
from hf_resumable import ResumableTrainer
from hf_resumable.demo.train import build_model, load_corpus

BLOCK = 32
samples = load_corpus(BLOCK)

class Blocks(torch.utils.data.Dataset):
    def __len__(self):
        return len(samples)
    def __getitem__(self, i):
        return {"input_ids": samples[i], "labels": samples[i]}

def make_trainer(output_dir, push_to=None):
    args = TrainingArguments(output_dir=output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=3e-3, logging_steps=1,
                             save_steps=SAVE_STEPS, save_total_limit=2, seed=7, report_to=[], use_cpu=True,
                             disable_tqdm=True)
    return ResumableTrainer(model=build_model(seed=7, block_size=BLOCK), args=args, train_dataset=Blocks(),
                            push_checkpoints_to=push_to)"""),
    new_code_cell("""# 4. The first runtime: train, pushing each checkpoint to the Hub, until the runtime is lost
class RuntimeLost(Exception):
    pass

class LoseRuntime(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == RUNTIME_LOST_AT:
            raise RuntimeLost(f"runtime disconnected at step {state.global_step}")

first = make_trainer(f"{WORK}/runtime-1", push_to=REPO_ID)
first.add_callback(LoseRuntime())
try:
    first.train()
except RuntimeLost as lost:
    print(lost)
first.wait_for_uploads()   # a real disconnect loses in-flight uploads; checkpoints already confirmed survive
losses_before = {h["step"]: h["loss"] for h in first.state.log_history if "loss" in h}
shutil.rmtree(f"{WORK}/runtime-1")   # the runtime's disk is gone with it
del first"""),
    new_code_cell("""# 5. A new runtime: nothing local; resume from the newest checkpoint on the Hub
second = make_trainer(f"{WORK}/runtime-2", push_to=REPO_ID)
second.train(resume_from_checkpoint=f"hf://{REPO_ID}")
print("resumed from", second.resumed_from)
resumed = {h["step"]: h["loss"] for h in second.state.log_history if "loss" in h}"""),
    new_code_cell("""# 6. Check against a run that was never interrupted, and plot the unbroken curve
reference = make_trainer(f"{WORK}/reference")
reference.train()
expected = {h["step"]: h["loss"] for h in reference.state.log_history if "loss" in h}
assert resumed == expected, "the resumed run differs from the uninterrupted one"
for name, value in reference.model.state_dict().items():
    assert torch.equal(value, second.model.state_dict()[name]), name
print(f"all {len(expected)} logged losses and every final weight match bit for bit")

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
steps = sorted(expected)
plt.figure(figsize=(7, 3.5))
plt.plot(steps, [expected[s] for s in steps], lw=4, alpha=0.4, label="never interrupted")
plt.plot(sorted(resumed), [resumed[s] for s in sorted(resumed)], "k.--", label="lost runtime + resumed from Hub")
plt.axvline(RUNTIME_LOST_AT, color="red", ls=":", label="runtime lost")
plt.xlabel("optimizer step"); plt.ylabel("training loss"); plt.legend(); plt.tight_layout()
plt.savefig(f"{WORK}/loss_curve.png")
plt.show()"""),
]


def main() -> None:
    notebook = new_notebook(cells=CELLS, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    })
    path = Path(__file__).with_name("resume_finetune_colab.ipynb")
    nbformat.write(notebook, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
