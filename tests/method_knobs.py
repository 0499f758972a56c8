"""One table of every method's knobs for the tiny test models (tests/conftest.py's make_tiny_model,
pages of 4 to 16 tokens, prompts of tens to a few hundred tokens): budgets and capacities below
those prompts, so each method's sparse path runs. A test that needs other values for its purpose
derives them from this table with an explicit override and says why, e.g.
`dict(METHOD_KNOBS["snapkv"], snapkv_capacity=64)`. tests/test_method_knobs.py checks that the
table names every registered method, so a new method cannot be left out of the tests that run
every method."""

METHOD_KNOBS = {
    "vanilla": {},
    "quest": dict(quest_token_budget=32, quest_skip_layers=1),
    "snapkv": dict(snapkv_capacity=48, snapkv_window_size=8),
    # layer 0 filters for every layer after it: valid on the 2-layer default tiny model too
    "omnikv": dict(omnikv_filter_layers=[0], omnikv_wait_layers=0, omnikv_num_selected=0.2),
    # a 16-token budget and 2 recent pages in a 10-page hot buffer; prompts of 64 tokens or more use the host
    "hisparse": dict(hisparse_token_budget=16, hisparse_recent_pages=2, hisparse_device_pages=10,
                     hisparse_min_prompt_len=64, hisparse_host_memory_gb=0.02),
    # full layers 0 and 2 need a model of 3 layers or more; deltakv_compressor_path is built by each
    # test for its model (a random compressor of the same full layers, cluster ratio and neighbors)
    "deltakv": dict(deltakv_full_layers=[0, 2], deltakv_sink=4, deltakv_recent=16, deltakv_cluster_ratio=0.25,
                    deltakv_neighbors=2),
}
