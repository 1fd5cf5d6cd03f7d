"""The media pipeline on the HPU (Gaudi only): Habana's API names, the graph, its reader node."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np


def media_api():
    """The Habana media-pipeline names the kit relies on, imported here only (Gaudi only).

    The same ones optimum-habana's contrastive-image-text example uses with habana-media-loader: ``MediaPipe(device,
    batch_size, prefetch_depth, pipe_name)`` subclassed with ``definegraph()``; ``fn.MediaExtReaderOp(impl,
    num_outputs, priv_params)`` with ``media_ext_reader_op_impl`` (``__init__(params, fw_params)``, ``__len__``,
    ``__iter__``, ``__next__``, ``gen_output_info``, ``get_largest_file``, ``get_media_output_type``) and
    ``media_ext_reader_op_tensor_info(dtype, shape innermost-first, layout)``; ``fn.ImageDecoder``,
    ``fn.MediaConst``, ``fn.CropMirrorNorm`` (taking images, mean and inv_std on the 0..255 scale); ``media_types``;
    ``HPUGenericPytorchIterator(mediapipe=...)``: ``iter()`` restarts the pipeline, ``next()`` returns the graph's
    outputs as torch tensors on the HPU; ``MediaPipe.del_iter()`` (stops the pipeline's worker, frees its device
    memory, releases the device) and ``MediaPipe.close()`` (frees the compiled graph), both harmless repeated.
    """
    from habana_frameworks.mediapipe import fn, media_types
    from habana_frameworks.mediapipe.mediapipe import MediaPipe
    from habana_frameworks.mediapipe.operators.reader_nodes import reader_nodes
    from habana_frameworks.mediapipe.plugins.iterator_pytorch import HPUGenericPytorchIterator

    return SimpleNamespace(
        fn=fn, types=media_types, MediaPipe=MediaPipe, reader_nodes=reader_nodes, iterator=HPUGenericPytorchIterator
    )


def build_pipeline(api, plan, pipe_name: str, inputs, batch_size: int, prefetch_depth: int, num_batches: int):
    """A loader's pipeline: read files -> HPU decode -> normalise; its reader node walks ``plan.batches``.

    ``inputs`` are the loader's ``MediaPipeInputs``. The decoder has one output shape per batch: it takes the
    centred square and resizes it (upstream resizes the shorter side, then crops: docs/UPSTREAM.md). The
    pipeline's shapes are fixed, so a short last batch is padded with its last file (and zero tokens), which the
    loader trims off; tokens travel as uint32 like upstream's reader.
    """
    fn, dtype, size = api.fn, api.types.dtype, inputs.image_size
    largest_file = max(set(inputs.file_paths), key=os.path.getsize)
    seq_length = int(inputs.input_ids.shape[1])
    # CropMirrorNorm's (mean, inv_std) on the 0..255 scale: (x - m) * s == (x / 255 - mean) / std
    mean_255 = (np.asarray(inputs.mean, dtype=np.float64) * 255.0).astype(np.float32)
    inv_std_255 = (1.0 / (np.asarray(inputs.std, dtype=np.float64) * 255.0)).astype(np.float32)

    class SamplerReaderNode(api.reader_nodes.media_ext_reader_op_impl):
        def __init__(self, params, fw_params):
            self._batches = iter(())

        def __len__(self):
            return num_batches

        def __iter__(self):
            self._batches = iter(plan.batches)
            return self

        def __next__(self):
            paths, input_ids, attention_mask = next(self._batches)
            missing = batch_size - len(paths)
            tokens = [np.pad(t.astype(np.uint32), ((0, missing), (0, 0))) for t in (input_ids, attention_mask)]
            return list(paths) + [paths[-1]] * missing, *tokens

        def get_media_output_type(self):
            return api.types.readerOutType.FILE_LIST

        def get_largest_file(self):
            return largest_file

        def gen_output_info(self):
            tokens_shape = np.array([seq_length, batch_size], dtype=np.uint32)  # innermost first
            info = api.reader_nodes.media_ext_reader_op_tensor_info
            return [
                info(dtype.NDT, np.array([batch_size], dtype=np.uint32), ""),
                info(dtype.UINT32, tokens_shape, ""),
                info(dtype.UINT32, tokens_shape, ""),
            ]

    class BridgeTowerMediaPipe(api.MediaPipe):
        def __init__(self):
            super().__init__(
                device="legacy", batch_size=batch_size, prefetch_depth=prefetch_depth, pipe_name=pipe_name
            )
            self._read = fn.MediaExtReaderOp(impl=SamplerReaderNode, num_outputs=3, priv_params={})
            self._decode = fn.ImageDecoder(
                device="hpu",
                output_format=api.types.imgtype.RGB_P,
                random_crop_type=api.types.randomCropType.CENTER_CROP,
                resize=[size, size],
                resampling_mode=api.types.ftype.BICUBIC,
            )
            self._mean = fn.MediaConst(data=mean_255, shape=[1, 1, 3], dtype=dtype.FLOAT32)
            self._inv_std = fn.MediaConst(data=inv_std_255, shape=[1, 1, 3], dtype=dtype.FLOAT32)
            self._normalise = fn.CropMirrorNorm(
                crop_w=size, crop_h=size, crop_pos_x=0.5, crop_pos_y=0.5, crop_d=0, dtype=dtype.FLOAT32
            )

        def definegraph(self):
            files, input_ids, attention_mask = self._read()
            return self._normalise(self._decode(files), self._mean(), self._inv_std()), input_ids, attention_mask

    return BridgeTowerMediaPipe()


def release_pipeline(pipe) -> None:
    """Stop a media pipeline and free what it holds on the device (the loader's finalizer)."""
    try:
        pipe.del_iter()
    finally:
        pipe.close()
