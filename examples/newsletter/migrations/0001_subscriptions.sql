CREATE TABLE subscriptions (
    email TEXT NOT NULL PRIMARY KEY,
    name TEXT NOT NULL,
    status TEXT NOT NULL
);
