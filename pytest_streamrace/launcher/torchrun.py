"""(placeholder until the launcher lands)"""


def install(config) -> None:
    pass
