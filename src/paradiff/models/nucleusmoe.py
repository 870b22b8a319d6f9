"""NucleusMoE's tiny examples: the parameters its class leaves uninitialised, for plans/nucleusmoe.py."""


def init_example(model) -> None:
    for name, param in model.named_parameters():  # the expert banks are created with torch.empty
        if ".experts." in name:
            param.normal_(std=0.1)
