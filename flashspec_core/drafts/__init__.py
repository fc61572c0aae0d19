"""Draft sources, one file each, all implementing `DraftSource` (base.py)."""
from flashspec_core.drafts.base import DraftSource
from flashspec_core.drafts.model import ModelDraft
from flashspec_core.drafts.prompt_lookup import PromptLookupDraft
from flashspec_core.drafts.suffix_cache import SuffixCacheDraft

__all__ = ["DraftSource", "ModelDraft", "PromptLookupDraft", "SuffixCacheDraft"]
