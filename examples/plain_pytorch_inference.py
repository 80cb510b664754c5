"""Classify scikit-learn's digits with an exported model, using nothing but PyTorch and scikit-learn.

    python -m app.export --ckpt runs/digits/checkpoints/last.ckpt --out model.pt
    python examples/plain_pytorch_inference.py model.pt

This file knows nothing of the project: it defines an equivalent network itself and loads the
weights with `weights_only=True`, so the file cannot run code when it is read.
"""

import sys

import torch
from sklearn.datasets import load_digits
from torch import nn


class SimpleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(torch.flatten(x, 1))))


def main() -> None:
    model = SimpleNet()
    model.load_state_dict(torch.load(sys.argv[1], map_location="cpu", weights_only=True))
    model.eval()
    images, labels = load_digits(return_X_y=True)
    inputs = torch.tensor(images / 16.0, dtype=torch.float32)
    with torch.no_grad():
        predictions = model(inputs).argmax(dim=1)
    accuracy = (predictions == torch.tensor(labels)).float().mean().item()
    print(f"accuracy {accuracy:.6f} on {len(labels)} digits")
    if len(sys.argv) > 2:  # optionally keep the predictions, for comparison
        torch.save(predictions, sys.argv[2])


if __name__ == "__main__":
    main()
