"""Images: decoding any image value, the image pipelines, JPEG headers, the decode-once cache, device decoding."""
