-- Which logical shards this database owns, out of how many. Written when tallyd first prepares
-- the database; tallyd refuses to start when its configured map disagrees with it.
CREATE TABLE tallyd.shards (
    shard          int PRIMARY KEY,
    logical_shards int NOT NULL
);
