"""Tests of fpaudit/integrations/: the Lightning and Hugging Face callbacks."""
