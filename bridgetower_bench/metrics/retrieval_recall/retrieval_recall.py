"""`evaluate` module: image <-> text retrieval recall@k and mean rank, loaded by path (README.md beside it).

It adapts ``bridgetower_bench.retrieval.retrieval_metrics`` to evaluate's interface: the package must be importable.
"""

import datasets
import evaluate
import numpy as np

from bridgetower_bench.retrieval import DEFAULT_KS, retrieval_metrics


_DESCRIPTION = """\
Image-to-text and text-to-image retrieval over one evaluation split. Each row is an
(image, caption) pair given as two embeddings; rows with the same image_group_ids value show the
same image and count as one image with several correct captions. Similarity is cosine.
i2t_recall@k: share of unique images with at least one of their captions among the k captions
most similar to it. t2i_recall@k: share of captions whose image is among the k most similar
unique images. *_mean_rank: mean 1-based rank of the best correct item (ties count against).
"""

_KWARGS_DESCRIPTION = """
Args:
    image_embeds (list of float lists): one image embedding per row.
    text_embeds (list of float lists): one caption embedding per row, same size as the images'.
    image_group_ids (list of int): rows with equal ids show the same image.
    ks (tuple of int, optional): the k of recall@k. Defaults to (1, 5, 10).
    chunk_size (int, optional): rows scored at a time; bounds memory. Defaults to 1024.
Returns:
    i2t_recall@k, t2i_recall@k (floats in [0, 1]), i2t_mean_rank, t2i_mean_rank (floats >= 1),
    num_images, num_captions (ints).
Example:
    >>> metric = evaluate.load("bridgetower_bench/metrics/retrieval_recall")
    >>> metric.compute(image_embeds=[[1.0, 0.0], [0.0, 1.0]], text_embeds=[[1.0, 0.1], [0.1, 1.0]],
    ...                image_group_ids=[0, 1])["t2i_recall@1"]
    1.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RetrievalRecall(evaluate.Metric):
    """Recall@k and mean rank, image->text and text->image, with repeated images grouped."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "image_embeds": datasets.Sequence(datasets.Value("float32")),
                    "text_embeds": datasets.Sequence(datasets.Value("float32")),
                    "image_group_ids": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, image_embeds, text_embeds, image_group_ids, ks=DEFAULT_KS, chunk_size=1024):
        return retrieval_metrics(
            np.asarray(image_embeds, dtype=np.float32),
            np.asarray(text_embeds, dtype=np.float32),
            np.asarray(image_group_ids, dtype=np.int64),
            ks=ks,
            chunk_size=chunk_size,
        )
