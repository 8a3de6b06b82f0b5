CREATE TABLE newsletter_issues (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    content TEXT NOT NULL,
    published_by TEXT NOT NULL
);

-- One row per confirmed subscriber and issue: what the delivery worker sends.
CREATE TABLE issue_delivery_queue (
    issue_id INTEGER NOT NULL REFERENCES newsletter_issues (id),
    subscriber_email TEXT NOT NULL,
    PRIMARY KEY (issue_id, subscriber_email)
);
