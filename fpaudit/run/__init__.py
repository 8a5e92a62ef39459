"""Running the user's code under the audit: model files, scan, verify, fp16-plan, training
scripts, several processes.
"""
