"""An HF Trainer script as the field writes it: ``--deepspeed ds.json`` with "auto" values the Trainer fills.

Run it by hand (on GPUs set --nproc_per_node to your GPUs), then tune it::

    torchrun --nproc_per_node 2 examples/dsat/train_hf.py --deepspeed examples/dsat/hf_ds_config.json \
        --output_dir /tmp/hf_out --per_device_train_batch_size 4 --max_steps 40 --report_to none
    python -m toolkit.dsat binary examples/dsat/hf_trainer.yaml examples/dsat --metric throughput

It never imports toolkit: dsat sets each trial's ``--per_device_train_batch_size`` and
``--gradient_accumulation_steps`` (which the Trainer's data loader follows) and gives it a config
file of its own in place of ``hf_ds_config.json``; the Trainer fills that file's "auto" values as it
fills yours. Needs ``transformers`` and ``accelerate`` (``pip install '.[hf]'``); no download: a small
GPT-2 is built from a config and trained on random tokens.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences; each is its own label (causal LM)."""

    def __init__(self, n: int = 4096, length: int = 32, vocab: int = 512) -> None:
        self.data = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=RandomTokens()).train()


if __name__ == "__main__":
    main()
