"""pyreft's trainers work with HF Trainer as it is today, under torchrun too: a group of fixes, one per failure mode.

- ``reft_compute_loss``: ``compute_loss`` as HF Trainer calls and reads it (``num_items_in_batch``, the whole batch's
  mean loss, ``(loss, outputs)``, the collated locations kept on the device).
- ``reft_train_loader``: the causal-LM trainers' training data sharded over the ranks, in HF Trainer's order.
- ``reft_classifier_evaluate``: the sequence classifier's ``evaluate`` with ``Trainer.evaluate``'s arguments, sharded.
- ``reft_tokenizer_keyword``: ``tokenizer=`` taken as transformers 5's ``processing_class``.
- ``reft_wrapped_checkpointing``: gradient checkpointing enabled inside a DDP wrapper handed to the trainer.
- ``reft_zero3_dtype``: a model ZeRO-3 partitioned in another precision than the run's, refused at ``train``.
- ``reft_rank_schedules``: ranks whose arguments schedule HF Trainer's collectives differently, or whose data
  differ, refused at ``train``.
- ``reft_spawned_ranks``: the ranks taken from the process group where ``mp.spawn`` left ``RANK`` and the others unset.

``pyreft_trainer`` names them all in ``patch(only=, exclude=)`` and in a package's ``FIXES``. Those that act when a
trainer is made or starts training (``reft_compute_loss``, ``reft_tokenizer_keyword``, ``reft_wrapped_checkpointing``,
``reft_zero3_dtype``, ``reft_rank_schedules``) share the ``__init__`` and ``train`` that ``mechanisms.trainer_steps`` adds to
``ReftTrainer``, each adding its step beside them. pyreft is patched when (and if) it is imported.
"""

from . import (reft_classifier_evaluate, reft_compute_loss, reft_rank_schedules, reft_spawned_ranks,
               reft_tokenizer_keyword, reft_train_loader, reft_wrapped_checkpointing, reft_zero3_dtype)

#: The group's fix modules (``fixes.GROUPS``; tests/test_fix_groups.py keeps it equal to the folder).
ALL = (reft_classifier_evaluate, reft_compute_loss, reft_rank_schedules, reft_spawned_ranks, reft_tokenizer_keyword,
       reft_train_loader, reft_wrapped_checkpointing, reft_zero3_dtype)
