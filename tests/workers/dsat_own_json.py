"""A loop that reads its own ds_config.json and sizes its DataLoader from it (issue 37's first client;
HelloDeepSpeed builds its dict the same way), with the one dsat line. Run from a directory holding
ds_config.json: ``torchrun --nproc_per_node 1 dsat_own_json.py``."""

import json
import os

import deepspeed
import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")) as f:
    config = json.load(f)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
data = TensorDataset(torch.randn(3000, 128))
loader = DataLoader(data, batch_size=config["train_micro_batch_size_per_gpu"], shuffle=True)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
step = 0
while step < 40:
    for (x,) in loader:
        with toolkit.dsat_reporting_context(engine):
            loss = torch.nn.functional.mse_loss(engine(x), x)
            engine.backward(loss)
            engine.step()
        step += 1
        if step >= 40:
            break
