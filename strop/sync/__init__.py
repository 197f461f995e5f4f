"""How the trainer's weights reach the engines: one class per transport behind one interface
(:class:`strop.sync.base.WeightSync`), and the one function that picks it (:func:`strop.sync.choose.choose_sync`)."""
