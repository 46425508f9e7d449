"""The pytest side of ``--streamrace``: running each test under a detector and judging its races (``plugin``), the
race record every other part reads and writes (``record``), how races are classified (``policy``), the session's
tally (``tally``), stream hints (``hints``) and the Chrome trace (``trace``). Data flows one way: the detector finds
races, this package turns them into records and reports; nothing in ``detector`` imports from here."""
