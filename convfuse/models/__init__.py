"""Model zoo: networks built from convfuse layers, with torchvision's state_dict keys."""

from .resnet import BasicBlock, ResNet, resnet18, resnet34

__all__ = ["BasicBlock", "ResNet", "resnet18", "resnet34"]
