"""The media pipeline on the HPU (Gaudi only): Habana's API names, the graph, its reader node.

The graph reads the files of a batch, decodes them on the HPU (the centred square, resized), then
normalises them (CropMirrorNorm). Its reader node hands the decoder the batches a ``MediaPipeDataLoader``
planned for the epoch (``EpochPlan``), in the trainer's sampler order. Habana's modules are imported by
``media_api()`` only, when called: this module imports on any machine, and its pure-Python parts
(normalisation constants, batch padding) are tested there.
"""

from __future__ import annotations

import weakref

import numpy as np


# Habana API names relied on, all imported in media_api() and nowhere else (the same ones
# optimum-habana's contrastive-image-text example uses with habana-media-loader):
#   habana_frameworks.mediapipe.mediapipe.MediaPipe(device, batch_size, prefetch_depth, pipe_name),
#       subclassed with definegraph();
#   habana_frameworks.mediapipe.fn.MediaExtReaderOp(impl, num_outputs, priv_params) with
#       operators.reader_nodes.reader_nodes.media_ext_reader_op_impl (__init__(params, fw_params),
#       __len__, __iter__, __next__, gen_output_info, get_largest_file, get_media_output_type)
#       and media_ext_reader_op_tensor_info(dtype, shape innermost-first, layout);
#   fn.ImageDecoder(device="hpu", output_format=imgtype.RGB_P, random_crop_type=
#       randomCropType.CENTER_CROP, resize=[w, h], resampling_mode=ftype.BICUBIC);
#   fn.MediaConst(data, shape, dtype); fn.CropMirrorNorm(crop_w, crop_h, crop_pos_x, crop_pos_y,
#       crop_d, dtype) taking (images, mean, inv_std) on the 0..255 scale;
#   media_types dtype.NDT/UINT32/FLOAT32, readerOutType.FILE_LIST;
#   plugins.iterator_pytorch.HPUGenericPytorchIterator(mediapipe=...): iter() restarts the
#       pipeline, next() returns the graph outputs as torch tensors on the HPU;
#   MediaPipe.del_iter() (stops the pipeline's worker, frees its device memory, releases the
#       device) and MediaPipe.close() (frees the compiled graph); both do nothing when repeated.
#
# Geometry: the decoder cannot resize each image to its own aspect-preserving size (a batch has
# one output shape), so it takes the centred square of side min(width, height) and resizes that to
# image_size x image_size with its bicubic filter. Upstream's PyTorch path resizes the shorter side
# to image_size first (longer side int(size * long / short)) and then centre-crops: the same image
# region up to under one output pixel of offset, but not bit-exact (different resampling kernel;
# torchvision antialiases in float). CropMirrorNorm's crop is then the whole image; it normalises.


def media_api():
    """Import the Habana media-pipeline names the kit relies on (Gaudi only)."""
    from types import SimpleNamespace

    from habana_frameworks.mediapipe import fn
    from habana_frameworks.mediapipe.media_types import dtype, ftype, imgtype, randomCropType, readerOutType
    from habana_frameworks.mediapipe.mediapipe import MediaPipe
    from habana_frameworks.mediapipe.operators.reader_nodes.reader_nodes import (
        media_ext_reader_op_impl,
        media_ext_reader_op_tensor_info,
    )
    from habana_frameworks.mediapipe.plugins.iterator_pytorch import HPUGenericPytorchIterator

    return SimpleNamespace(
        fn=fn,
        dtype=dtype,
        ftype=ftype,
        imgtype=imgtype,
        randomCropType=randomCropType,
        readerOutType=readerOutType,
        MediaPipe=MediaPipe,
        media_ext_reader_op_impl=media_ext_reader_op_impl,
        media_ext_reader_op_tensor_info=media_ext_reader_op_tensor_info,
        HPUGenericPytorchIterator=HPUGenericPytorchIterator,
    )


def normalisation_constants(mean, std) -> tuple[np.ndarray, np.ndarray]:
    """CropMirrorNorm's (mean, inv_std) on the 0..255 scale: (x - m) * s == (x / 255 - mean) / std."""
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    return (mean * 255.0).astype(np.float32), (1.0 / (std * 255.0)).astype(np.float32)


def pad_batch_for_pipeline(paths, input_ids, attention_mask, batch_size: int):
    """A batch as the reader node hands it over: always ``batch_size`` rows.

    The pipeline's shapes are fixed, so a short last batch is padded by repeating its last file
    (and zero tokens); the loader trims the padding off the decoded images. Tokens travel as uint32
    like upstream's reader; the loader itself yields the exact int64 host arrays.
    """
    missing = batch_size - len(paths)
    files = list(paths) + [paths[-1]] * missing
    pad = ((0, missing), (0, 0))
    return (
        files,
        np.pad(input_ids.astype(np.uint32), pad),
        np.pad(attention_mask.astype(np.uint32), pad),
    )


class EpochPlan:
    """The batches of the epoch being read, shared by a loader and its reader node."""

    def __init__(self):
        self.batches: list = []


# Reader nodes find their loader's plan by key: the pipeline may copy its params, a string survives.
_EPOCH_PLANS: weakref.WeakValueDictionary[str, EpochPlan] = weakref.WeakValueDictionary()


def _reader_node_class(api):
    class SamplerReaderNode(api.media_ext_reader_op_impl):
        """Media reader node: hands the decoder the current epoch's files, batch by batch."""

        def __init__(self, params, fw_params):
            private = params["priv_params"]
            if private["plan_key"] not in _EPOCH_PLANS:
                raise RuntimeError("media reader node started without its loader (was the pipeline copied?)")
            self._plan = _EPOCH_PLANS[private["plan_key"]]
            self._num_batches = private["num_batches"]
            self._largest_file = private["largest_file"]
            self._seq_length = private["max_seq_length"]
            self._batch_size = fw_params.batch_size
            self._batches = iter(())

        def __len__(self):
            return self._num_batches

        def __iter__(self):
            self._batches = iter(self._plan.batches)
            return self

        def __next__(self):
            return pad_batch_for_pipeline(*next(self._batches), self._batch_size)

        def get_media_output_type(self):
            return api.readerOutType.FILE_LIST

        def get_largest_file(self):
            return self._largest_file

        def gen_output_info(self):
            files_shape = np.array([self._batch_size], dtype=np.uint32)
            tokens_shape = np.array([self._seq_length, self._batch_size], dtype=np.uint32)  # innermost first
            info = api.media_ext_reader_op_tensor_info
            return [
                info(api.dtype.NDT, files_shape, ""),
                info(api.dtype.UINT32, tokens_shape, ""),
                info(api.dtype.UINT32, tokens_shape, ""),
            ]

    return SamplerReaderNode


def _pipe_class(api):
    class BridgeTowerMediaPipe(api.MediaPipe):
        """read files -> HPU decode (centre square, resize) -> crop + normalise (CropMirrorNorm)."""

        def __init__(self, *, batch_size, prefetch_depth, pipe_name, reader_params, image_size, mean, std):
            super().__init__(
                device="legacy", batch_size=batch_size, prefetch_depth=prefetch_depth, pipe_name=pipe_name
            )
            fn = api.fn
            mean_255, inv_std_255 = normalisation_constants(mean, std)
            self._read = fn.MediaExtReaderOp(impl=_reader_node_class(api), num_outputs=3, priv_params=reader_params)
            self._decode = fn.ImageDecoder(
                device="hpu",
                output_format=api.imgtype.RGB_P,
                random_crop_type=api.randomCropType.CENTER_CROP,
                resize=[image_size, image_size],
                resampling_mode=api.ftype.BICUBIC,
            )
            self._mean = fn.MediaConst(data=mean_255, shape=[1, 1, 3], dtype=api.dtype.FLOAT32)
            self._inv_std = fn.MediaConst(data=inv_std_255, shape=[1, 1, 3], dtype=api.dtype.FLOAT32)
            self._normalise = fn.CropMirrorNorm(
                crop_w=image_size, crop_h=image_size, crop_pos_x=0.5, crop_pos_y=0.5, crop_d=0, dtype=api.dtype.FLOAT32
            )

        def definegraph(self):
            files, input_ids, attention_mask = self._read()
            images = self._normalise(self._decode(files), self._mean(), self._inv_std())
            return images, input_ids, attention_mask

    return BridgeTowerMediaPipe


def build_pipeline(
    api,
    plan: EpochPlan,
    pipe_name: str,
    *,
    batch_size: int,
    prefetch_depth: int,
    num_batches: int,
    largest_file: str,
    max_seq_length: int,
    image_size: int,
    mean,
    std,
):
    """A loader's media pipeline, its reader node walking ``plan`` (known by ``pipe_name`` until released)."""
    _EPOCH_PLANS[pipe_name] = plan
    return _pipe_class(api)(
        batch_size=batch_size,
        prefetch_depth=prefetch_depth,
        pipe_name=pipe_name,
        reader_params={
            "plan_key": pipe_name,
            "num_batches": num_batches,
            "largest_file": largest_file,
            "max_seq_length": max_seq_length,
        },
        image_size=image_size,
        mean=mean,
        std=std,
    )


def release_pipeline(pipe, pipe_name: str) -> None:
    """Stop a media pipeline and free what it holds on the device (the loader's finalizer)."""
    _EPOCH_PLANS.pop(pipe_name, None)
    try:
        pipe.del_iter()
    finally:
        pipe.close()
