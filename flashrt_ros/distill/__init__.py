"""Tools that train parts of a checkpoint from the model itself (an MTP head for speculative decoding)."""
