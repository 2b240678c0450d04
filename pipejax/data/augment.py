"""Per-example image transforms: train-time augmentations and the ImageNet eval crop.

Images are channels-last uint8 numpy arrays. Augmentations take the generator that the stream
derives from (seed, epoch, position), and always draw the same amount of randomness in the same
order, so one example's draws never depend on another's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from PIL import Image


@dataclasses.dataclass(frozen=True)
class PadCropFlip:
  """Zero-pad by ``pad`` pixels, crop back to the original size at random, flip at random.

  The standard CIFAR augmentation (pad 4, random 32×32 crop, horizontal flip with p=1/2), as in
  He et al. 2016. Padding is with 0 (black) in stored units.
  """

  pad: int = 4
  flip: bool = True

  def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    height, width = image.shape[:2]
    top, left = rng.integers(0, 2 * self.pad + 1, size=2)
    do_flip = rng.random() < 0.5
    # The window of the padded image, built without padding: np.pad would cost 3x the rest.
    dy, dx = int(top) - self.pad, int(left) - self.pad
    out = np.zeros_like(image)
    out[max(0, -dy):height - max(0, dy), max(0, -dx):width - max(0, dx)] = (
        image[max(0, dy):height + min(0, dy), max(0, dx):width + min(0, dx)])
    if self.flip and do_flip:
      out = out[:, ::-1]
    return np.ascontiguousarray(out)


def _resize_box(image: np.ndarray, box: tuple[int, int, int, int], size: int) -> np.ndarray:
  """Crops ``box`` = (left, top, right, bottom) and resizes it to ``size``×``size`` (bilinear).

  PIL does both in one resampling, with antialiasing when it shrinks.
  """
  squeeze = image.ndim == 3 and image.shape[-1] == 1
  pil = Image.fromarray(image[..., 0] if squeeze else image)
  out = np.asarray(pil.resize((size, size), Image.BILINEAR, box=box))
  return out[..., None] if squeeze else out


def center_crop_resize(image: np.ndarray, size: int, crop_fraction: float = 0.875) -> np.ndarray:
  """Eval-time ImageNet preparation: central square crop, resized to ``size``×``size``.

  The square's side is ``crop_fraction`` of the shorter side (0.875: the usual 224-of-256).
  """
  height, width = image.shape[:2]
  side = max(1, int(round(crop_fraction * min(height, width))))
  top, left = (height - side) // 2, (width - side) // 2
  return _resize_box(image, (left, top, left + side, top + side), size)


@dataclasses.dataclass(frozen=True)
class RandomResizedCropFlip:
  """Train-time ImageNet augmentation: Inception-style random-resized crop, then flip.

  A crop covering a ``scale`` fraction of the area with aspect ratio in ``ratio`` (log-uniform)
  is tried ``attempts`` times; if none fits, the eval centre crop is used. The crop is resized to
  ``size``×``size`` and flipped horizontally with p=1/2 (torchvision's RandomResizedCrop).
  """

  size: int
  scale: tuple[float, float] = (0.08, 1.0)
  ratio: tuple[float, float] = (3 / 4, 4 / 3)
  attempts: int = 10

  def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    height, width = image.shape[:2]
    # Draw every attempt's numbers up front so the amount of randomness used is fixed.
    areas = rng.uniform(*self.scale, size=self.attempts) * height * width
    ratios = np.exp(rng.uniform(np.log(self.ratio[0]), np.log(self.ratio[1]), size=self.attempts))
    corners = rng.random((self.attempts, 2))
    do_flip = rng.random() < 0.5
    out = None
    for area, ratio, (u, v) in zip(areas, ratios, corners):
      crop_w = int(round(np.sqrt(area * ratio)))
      crop_h = int(round(np.sqrt(area / ratio)))
      if 0 < crop_w <= width and 0 < crop_h <= height:
        top = int(u * (height - crop_h + 1))
        left = int(v * (width - crop_w + 1))
        out = _resize_box(image, (left, top, left + crop_w, top + crop_h), self.size)
        break
    if out is None:
      out = center_crop_resize(image, self.size)
    if do_flip:
      out = out[:, ::-1]
    return np.ascontiguousarray(out)
