"""The published experiment's facts (docs/PUBLISHED.md), their one home: for the GPU memory check and the tools."""

MODEL = "BridgeTower/bridgetower-large-itm-mlm-itc"
DATASET = "jmhessel/newyorker_caption_contest"
DATASET_CONFIG = "matching"
# The first commit of the data set with its `matching` config as parquet files (and no loading script): the
# revision the published commands pin (docs/PUBLISHED.md, "The data set revision").
DATASET_REVISION = "a1b7cdbc813771f4ccf1ddb491a29d05d09bd532"
# The revision upstream's README and CI pin: a loading script, which `datasets` 4 and later refuse to run.
UPSTREAM_CI_DATASET_REVISION = "3c6c4f6c0ff7e902833d3afa5f8f3875c2b036e6"
MODEL_REVISION = "main"  # the published commands pass no --model_revision
GAUDI_CONFIG = "Habana/clip"  # --gaudi_config_name of the published Gaudi command
IMAGE_COLUMN = "image"
CAPTION_COLUMN = "image_description"

# The recipe, the same on every accelerator.
DEVICES = 8
BATCH = 48  # per device
EPOCHS = 5
WARMUP_STEPS = 3  # --throughput_warmup_steps
# The train split of `matching`, "about 9.8k rows" as documented: the real count lies within 50 rows of it.
TRAIN_ROWS = 9_800
SAMPLES = EPOCHS * TRAIN_ROWS
EXPERIMENT = f"{EPOCHS} epochs x about {TRAIN_ROWS:,} rows"

# BridgeTower Large: (hidden size, text layers, vision layers, cross-modal layers, image size, patch size),
# captions of 128 tokens, and the parameters trained.
SHAPE = (1024, 24, 24, 6, 294, 14)
SEQUENCE = 128
TRAINED_PARAMETERS = 865_612_289  # BridgeTowerForContrastiveLearning without the text pooler (removed by default)

# The published whole-node (DEVICES devices) throughput, samples/s, by configuration.
CONFIGS = ("workers=0", "workers=1", "workers=2", "workers=2 + mediapipe")
THROUGHPUT = {
    "Gaudi2 HPU": {"workers=0": 601.5, "workers=1": 747.4, "workers=2": 768.7, "workers=2 + mediapipe": 847.7},
    "H100 GPU": {"workers=0": 336.5, "workers=1": 580.1, "workers=2": 602.1},
    "A100 80GB GPU": {"workers=0": 227.5, "workers=1": 339.7, "workers=2": 345.4},
}
# Upstream's CI baselines (DEVICES devices, samples/s), the release line that recorded them, and the flags CI adds to the
# post's. The line is the baselines' own: a bump of optimum-habana moves it only when the baselines are read again.
CI_RELEASE_LINE = "optimum-habana 1.21 line"
CI_BASELINES = {"Gaudi2 HPU": 904.93, "Gaudi3 HPU": 783.481}
CI_EXTRA_FLAGS = f"--dataset_revision {UPSTREAM_CI_DATASET_REVISION} --trust_remote_code True --sdp_on_bf16"
