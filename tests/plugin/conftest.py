# The sample project is a user's project with a pytest configuration of its own: it is run by
# test_testing_plugin.py in a pytest process of its own, never collected into this suite.
collect_ignore = ["sample_project", "django_project"]
